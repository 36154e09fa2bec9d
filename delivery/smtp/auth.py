"""Credentials for AUTH to next hops (Postfix's ``smtp_sasl_password_maps``).

``MAILRELAY_SMTP_AUTH`` names a file of lines::

    # next hop                  username:password            flags
    [smtp.office365.com]:587    relay@example.com:s3cret
    [10.0.0.5]:25               relay:secret                 allow-cleartext
    smtp.provider.net           user:pass

The next hop is written as in the transport map or smart host: ``[host]:port``
or ``[host]`` for a host used as is, ``host:port`` or ``host`` for a name
(looked up for MX); a line also matches a host it expands to, and the MX host
names themselves. The password is everything after the first colon (it may
contain colons, not spaces). Credentials are never sent without TLS unless
the line says ``allow-cleartext``, nor over TLS whose certificate was not
verified (policy ``may``/``encrypt``) unless the line says ``allow-cleartext``
or ``MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS`` is set (``delivery.smtp.connection``). With
``MAILRELAY_SMTP_AUTH_FILE`` (a mounted secret) the setting's value is the
file's content itself.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field

from django.conf import settings

ALLOW_CLEARTEXT = "allow-cleartext"


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)  # never in logs or reprs
    allow_cleartext: bool = False

    def plain(self) -> bytes:
        """The AUTH PLAIN initial response (RFC 4616): NUL user NUL password."""
        raw = b"\0" + self.username.encode() + b"\0" + self.password.encode()
        return base64.b64encode(raw)


def _key(spec: str) -> str:
    return spec.strip().lower()


def parse(text: str) -> dict[str, Credentials]:
    """Next hop → credentials; raises ValueError naming the line (not the password)."""
    table: dict[str, Credentials] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2 or ":" not in parts[1]:
            raise ValueError(f"line {number}: expected 'next-hop username:password [flags]'")
        flags = parts[2:]
        unknown = [f for f in flags if f != ALLOW_CLEARTEXT]
        if unknown:
            raise ValueError(f"line {number}: unknown flag {unknown[0]!r} (known: allow-cleartext)")
        username, _, password = parts[1].partition(":")
        if not username:
            raise ValueError(f"line {number}: empty username")
        table[_key(parts[0])] = Credentials(username, password, ALLOW_CLEARTEXT in flags)
    return table


_loaded: tuple[tuple[str, float], dict[str, Credentials]] | None = None


def load() -> dict[str, Credentials]:
    """The table of ``MAILRELAY_SMTP_AUTH`` (a path, or the content from a
    ``_FILE`` secret), read again when the file changes."""
    global _loaded
    value = settings.MAILRELAY_SMTP_AUTH
    if not value.strip():
        return {}
    path = value.strip()
    if any(ch.isspace() for ch in path):  # content (a _FILE secret), not a path
        return parse(value)
    if not os.path.isfile(path):
        raise ValueError(f"file {path!r} does not exist")
    stamp = (path, os.stat(path).st_mtime)
    if _loaded is None or _loaded[0] != stamp:
        with open(path, encoding="utf-8") as fh:
            _loaded = (stamp, parse(fh.read()))
    return _loaded[1]


def lookup(table: dict[str, Credentials], names: list[str]) -> Credentials | None:
    """The credentials of the first of ``names`` (next-hop spellings, most
    specific first) that has a line."""
    for name in names:
        creds = table.get(_key(name))
        if creds is not None:
            return creds
    return None
