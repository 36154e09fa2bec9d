"""RFC 5321 paths: an envelope address parsed and its domain in its one form.

Pure (no network, database or settings). Every way a message comes in uses
it, once: the SMTP server's MAIL and RCPT (delivery.smtpd.policy), pickup and
replay, and an operator's corrected envelope (queues.services.envelope_edits).

A path's domain is normalised here for all of them (``queues.lib``: IDNA
2008 with UTS #46 mapping): a ``Mailbox`` carries the local part exactly as
given and the domain in its envelope form, so ``victim@ｅｘａｍｐｌｅ.test`` is
stored as ``victim@example.test``; relay control (``domain_key``) and routing
use its A-label key.
"""

from __future__ import annotations

import ipaddress
import re
import string
from dataclasses import dataclass

from queues import lib

# Our columns (Message.mail_from, Recipient.address) hold 512 characters;
# RFC 5321 4.5.3.1.3 allows 256 octets for a whole path.
MAX_ADDRESS_LENGTH = 500
MAX_DOMAIN_LENGTH = 255
_ATEXT = frozenset(string.ascii_letters + string.digits + "!#$%&'*+-/=?^_`{|}~")
# Real-world local parts break the dot-atom rules ("a..b", "a.") and nobody
# is harmed by relaying them, so dots are accepted anywhere.
_LOCAL_CHARS = _ATEXT | {"."}
# Letters, digits, hyphen; underscore too, as Postfix allows it in host names.
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?\Z")


class PathSyntaxError(ValueError):
    pass


class NeedsSMTPUTF8(ValueError):  # noqa: N818
    pass


class BadDomain(PathSyntaxError):  # noqa: N818
    """The domain has no normalised (IDNA) form; the text says why."""


def domain_key(domain: str) -> str:
    """A domain as compared with MAILRELAY_ACCEPTED_DOMAINS: its one form.

    ``queues.lib.domain_key``: so ``ｅｘａｍｐｌｅ.test`` matches ``example.test``
    and an SMTPUTF8 recipient ``exämple.com`` matches ``xn--exmple-cua.com``. A
    domain without a form (never one of a parsed ``Mailbox``) is compared in
    lower case, without the final dot, and so matches no accepted domain.
    """
    try:
        return lib.domain_key(domain)
    except lib.DomainError:
        return domain.rstrip(".").lower()


@dataclass(frozen=True)
class Mailbox:
    """An RFC 5321 path: the local part as given (quotes and case kept), the
    domain checked and in its envelope form (``queues.lib.envelope_domain``)."""

    local: str
    domain: str  # "" when the client gave none; an address literal as given
    route: tuple[str, ...] = ()  # the A-d-l of "<@a,@b:user@c>", without the "@"

    @property
    def address(self) -> str:
        return f"{self.local}@{self.domain}" if self.domain else self.local

    @property
    def domain_key(self) -> str:
        return domain_key(self.domain)

    @property
    def routes_by_sender(self) -> bool:
        """Does the address carry sender-specified routing?

        A source route, or a "%", "!" or "@" in the local part (quoted or not):
        ``user%host@relay``, ``host!user``, ``"user@ext"@relay`` all ask the
        relay to pass mail on somewhere the domain part does not say.
        """
        local = self.local
        return bool(self.route) or "%" in local or "!" in local or "@" in local


# --------------------------------------------------------------------------- paths


def _is_utf8(ch: str) -> bool:
    """A non-ASCII character that came from valid UTF-8 (not a surrogateescape byte)."""
    code = ord(ch)
    return code > 127 and not 0xD800 <= code <= 0xDFFF


def _check_chars(text: str, utf8: bool) -> None:
    for ch in text:
        code = ord(ch)
        if code < 33 or code == 127 or 0xD800 <= code <= 0xDFFF:
            # controls, space, and undecodable bytes (surrogateescape)
            raise PathSyntaxError(f"character {ch!r} not allowed")
        if code > 127 and not utf8:
            raise NeedsSMTPUTF8()


def _parse_domain(text: str) -> str:
    """A domain or address literal → its one form (a literal as given); or
    PathSyntaxError (BadDomain when it is a name without an IDNA form)."""
    if not text:
        raise PathSyntaxError("empty domain")
    if len(text) > MAX_DOMAIN_LENGTH:
        raise PathSyntaxError("domain too long")
    if text.startswith("["):
        if not text.endswith("]"):
            raise PathSyntaxError("bad address literal")
        inner = text[1:-1]
        try:
            if inner[:5].lower() == "ipv6:":
                ipaddress.IPv6Address(inner[5:])
            else:
                ipaddress.IPv4Address(inner)
        except ValueError:
            raise PathSyntaxError("bad address literal") from None
        return text
    if text.isascii():
        # Plain syntax first, so that "a b" or "a..b" stays a syntax error.
        labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
        for label in labels:
            if not _LABEL.match(label) or len(label) > 63:
                raise PathSyntaxError(f"bad domain label {label!r}")
    try:
        return lib.envelope_domain(text)
    except lib.DomainError as exc:
        raise BadDomain(str(exc)) from None


def _parse_local(text: str, utf8: bool) -> tuple[str, str]:
    """Return (local part as given, what follows it)."""
    if text.startswith('"'):
        pos = 1
        while pos < len(text):
            ch = text[pos]
            if ch == "\\":
                if pos + 1 >= len(text):
                    break
                pos += 2
                continue
            if ch == '"':
                return text[: pos + 1], text[pos + 1 :]
            pos += 1
        raise PathSyntaxError("unterminated quoted local part")
    local, at, rest = text.partition("@")
    if not local:
        raise PathSyntaxError("empty local part")
    for ch in local:
        if ch not in _LOCAL_CHARS and not (utf8 and _is_utf8(ch)):
            raise PathSyntaxError(f"character {ch!r} not allowed in local part")
    return local, at + rest


def _check_quoted(local: str, utf8: bool) -> None:
    # qtextSMTP is %d32-33 / %d35-91 / %d93-126; quoted-pairSMTP is "\" %d32-126.
    body = local[1:-1]
    pos = 0
    while pos < len(body):
        code = ord(body[pos])
        if code == 92:
            pos += 1
            if pos >= len(body) or not 32 <= ord(body[pos]) <= 126:
                raise PathSyntaxError("bad quoted pair")
        elif code < 32 or code in (34, 127) or (code > 127 and not (utf8 and _is_utf8(body[pos]))):
            raise PathSyntaxError("bad character in quoted local part")
        pos += 1


def parse_mailbox(path: str, *, utf8: bool) -> Mailbox | None:
    """Parse the inside of ``<...>``; ``None`` is the null path ``<>``.

    Raises ``PathSyntaxError``, or ``NeedsSMTPUTF8`` for non-ASCII without it.
    """
    if path == "":
        return None
    if len(path) > MAX_ADDRESS_LENGTH:
        raise PathSyntaxError("address too long")
    if not utf8 and not path.isascii():
        raise NeedsSMTPUTF8()
    route: list[str] = []
    if path.startswith("@"):
        adl, colon, path = path.partition(":")
        if not colon:
            raise PathSyntaxError("source route without ':'")
        for hop in adl.split(","):
            if not hop.startswith("@"):
                raise PathSyntaxError("bad source route")
            route.append(_parse_domain(hop[1:]))
    # Quoted local parts may hold spaces; check raw characters outside them only.
    local, rest = _parse_local(path, utf8)
    if local.startswith('"'):
        _check_quoted(local, utf8)
        if len(local) < 3:
            raise PathSyntaxError("empty quoted local part")
    if not rest:
        return Mailbox(local, "", tuple(route))
    if not rest.startswith("@"):
        raise PathSyntaxError("text after the local part")
    domain = rest[1:]
    _check_chars(domain, utf8)
    return Mailbox(local, _parse_domain(domain), tuple(route))
