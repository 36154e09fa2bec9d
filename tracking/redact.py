"""Credentials kept out of what viewers read: a webhook URL's userinfo password
and its query values (tokens are often passed so) are replaced by ``***`` in
the audit log (issue #20). The endpoint keeps its URL; admins see it in full."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
_URL = re.compile(r"https?://\S+", re.IGNORECASE)


def url(text: str) -> str:
    """``text`` (a URL) with the password of its userinfo (a user alone: the user),
    every query value and the fragment masked; query names, host and path kept."""
    try:
        parts = urlsplit(text)
    except ValueError:
        return MASK
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at:  # a user alone may be a token (https://TOKEN@host/): masked too
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user if colon else MASK}{colon and ':' + MASK}@{hostport}"
    query = "&".join(
        f"{name}={MASK}" if sep else MASK  # a bare ?TOKEN too
        for name, sep, _value in (pair.partition("=") for pair in parts.query.split("&"))
        if name or sep
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, MASK if parts.fragment else ""))


def text(value: str) -> str:
    """``value`` with every http(s) URL in it masked as ``url`` does."""
    return _URL.sub(lambda m: url(m.group(0)), value)
