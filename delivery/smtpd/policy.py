"""Pure inbound policy: RFC 5321 paths, ESMTP parameters, and the relay decision.

Nothing here touches the network, the database or settings; the server
passes in what it read at start. Every refusal is a ``Refused`` carrying a
reply from ``replies`` (or one of the two below).

A path is parsed, and its domain normalised, once, for SMTP, pickup, replay
and an operator's edits alike (``queues.addresses``: a ``Mailbox`` carries the
local part exactly as given and the domain in its envelope form); relay
control (``domain_key``) and routing use its A-label key. A domain with no
form is refused with 553.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

# The path parser lives in the store, below every way mail comes in (an
# operator's corrected envelope too); its names are the policy's as well.
from queues.addresses import (  # noqa: F401 - BadDomain, domain_key: policy's names too
    BadDomain,
    Mailbox,
    NeedsSMTPUTF8,
    PathSyntaxError,
    domain_key,
    parse_mailbox,
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_ENVID_LENGTH = 100  # RFC 3461 4.4
MAX_ORCPT_LENGTH = 500  # RFC 3461 4.2

_ESMTP_KEYWORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*\Z")
# esmtp-value: %d33-60 / %d62-126, plus UTF-8 (RFC 6531 3.3)
_ESMTP_VALUE = re.compile(r"[!-<>-~\u0080-\ud7ff\ue000-\U0010ffff]+\Z")
# xtext (RFC 3461 4): "!".."~" except "+" and "=", or "+" and two upper-case hex digits
_XTEXT = re.compile(r"(?:[!-*,-<>-~]|\+[0-9A-F]{2})*\Z")
# utf-8-addr-xtext / -unitext (RFC 6533 3): QCHAR, \x{HEX}, and UTF-8 with SMTPUTF8
_UTF8_ADDR_ASCII = re.compile(r"(?:[!-*,-<>-\[\]-~]|\\x\{[0-9A-Fa-f]{1,6}\})+\Z")
_UTF8_ADDR_UNICODE = re.compile(
    r"(?:[!-*,-<>-\[\]-~\u0080-\ud7ff\ue000-\U0010ffff]|\\x\{[0-9A-Fa-f]{1,6}\})+\Z"
)
_ADDR_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*\Z")
_NOTIFY_VALUES = ("SUCCESS", "FAILURE", "DELAY")

# A domain without an IDNA form. RFC 3463: X.1.3 is a bad destination
# mailbox address syntax; for the sender X.1.7 (bad sender's mailbox address
# syntax) is the one meant, not X.1.8 (the sender's system does not exist).
BAD_RECIPIENT_DOMAIN = "553 5.1.3 Bad recipient domain: not a valid domain name (IDNA)"
BAD_SENDER_DOMAIN = "553 5.1.7 Bad sender domain: not a valid domain name (IDNA)"


class Refused(Exception):  # noqa: N818 - it is a refusal, not an "error"
    """A command is refused; ``reply`` is what the client gets."""

    def __init__(self, reply: str) -> None:
        super().__init__(reply)
        self.reply = reply


@dataclass(frozen=True)
class MailParams:
    size: int | None = None
    body: str = ""  # "7BIT" / "8BITMIME" / "" (not given)
    smtputf8: bool = False
    ret: str = ""  # "FULL" / "HDRS" / ""
    envid: str = ""  # xtext, exactly as given


@dataclass(frozen=True)
class RcptParams:
    notify: str = ""  # "NEVER" or e.g. "SUCCESS,FAILURE"
    orcpt: str = ""  # "addr-type;xtext", exactly as given


# --------------------------------------------------------------------------- paths


def split_path(arg: str) -> tuple[str, str, bool]:
    """Split the text after ``FROM:``/``TO:`` into (path, parameters, bracketed).

    A space after the colon and a path without angle brackets are tolerated
    (many clients send them); a ``>`` inside a quoted local part does not end
    the path.
    """
    text = arg.lstrip(" ")
    if not text.startswith("<"):
        path, _, rest = text.partition(" ")
        return path, rest, False
    in_quote = escaped = False
    for pos in range(1, len(text)):
        ch = text[pos]
        if escaped:
            escaped = False
        elif in_quote and ch == "\\":
            escaped = True
        elif ch == '"':
            in_quote = not in_quote
        elif ch == ">" and not in_quote:
            rest = text[pos + 1 :]
            if rest and not rest.startswith(" "):
                raise PathSyntaxError("text after the path")
            return text[1:pos], rest, True
    raise PathSyntaxError("no closing '>'")


# ----------------------------------------------------------------- ESMTP parameters


def _parameters(text: str) -> list[tuple[str, str | None]]:
    """``KEY=value KEY2`` → [("KEY", "value"), ("KEY2", None)]; keywords upper-cased."""
    seen: set[str] = set()
    result: list[tuple[str, str | None]] = []
    for token in text.split(" "):
        if not token:
            continue
        key, eq, value = token.partition("=")
        if not _ESMTP_KEYWORD.match(key) or (eq and not _ESMTP_VALUE.match(value)):
            raise Refused(PARAMETER_SYNTAX)
        key = key.upper()
        if key in seen:
            raise Refused(DUPLICATE_PARAMETER.format(name=key))
        seen.add(key)
        result.append((key, value if eq else None))
    return result


def parse_mail_params(text: str, *, max_size: int) -> MailParams:
    """MAIL FROM parameters: SIZE (RFC 1870), BODY (6152), SMTPUTF8 (6531), RET, ENVID (3461)."""
    size: int | None = None
    body = ret = envid = ""
    smtputf8 = False
    for key, value in _parameters(text):
        if key == "SIZE":
            if value is None or not value.isdigit() or not value.isascii() or len(value) > 20:
                raise Refused(BAD_PARAMETER.format(name=key))
            size = int(value)
            if max_size and size > max_size:
                raise Refused(MESSAGE_TOO_BIG)
        elif key == "BODY":
            body = (value or "").upper()
            if body not in ("7BIT", "8BITMIME"):
                raise Refused(BAD_PARAMETER.format(name=key))
        elif key == "SMTPUTF8":
            if value is not None:
                raise Refused(BAD_PARAMETER.format(name=key))
            smtputf8 = True
        elif key == "RET":
            ret = (value or "").upper()
            if ret not in ("FULL", "HDRS"):
                raise Refused(BAD_PARAMETER.format(name=key))
        elif key == "ENVID":
            if not value or len(value) > MAX_ENVID_LENGTH or not _XTEXT.match(value):
                raise Refused(BAD_PARAMETER.format(name=key))
            envid = value
        else:
            raise Refused(UNKNOWN_PARAMETER.format(name=key))
    return MailParams(size=size, body=body, smtputf8=smtputf8, ret=ret, envid=envid)


def _valid_orcpt(value: str, utf8: bool) -> bool:
    if len(value) > MAX_ORCPT_LENGTH:
        return False
    addr_type, semi, addr = value.partition(";")
    if not semi or not addr or not _ADDR_TYPE.match(addr_type):
        return False
    if addr_type.lower() == "utf-8":
        return bool((_UTF8_ADDR_UNICODE if utf8 else _UTF8_ADDR_ASCII).match(addr))
    return bool(_XTEXT.match(addr))


def parse_rcpt_params(text: str, *, utf8: bool) -> RcptParams:
    """RCPT TO parameters: NOTIFY and ORCPT (RFC 3461 4.1, 4.2; RFC 6533 for utf-8)."""
    notify = orcpt = ""
    for key, value in _parameters(text):
        if key == "NOTIFY":
            items: list[str] = []
            for item in (value or "").upper().split(","):
                if item not in items:
                    items.append(item)
            if items != ["NEVER"] and not all(item in _NOTIFY_VALUES for item in items):
                raise Refused(BAD_PARAMETER.format(name=key))
            notify = ",".join(items)
        elif key == "ORCPT":
            if value is None or not _valid_orcpt(value, utf8):
                raise Refused(BAD_PARAMETER.format(name=key))
            orcpt = value
        else:
            raise Refused(UNKNOWN_PARAMETER.format(name=key))
    return RcptParams(notify=notify, orcpt=orcpt)


# ------------------------------------------------------------------ the commands


def command_argument(keyword: str, arg: str) -> str | None:
    """What follows ``keyword`` ("FROM:", "TO:") in a MAIL/RCPT argument, or None.

    As aiosmtpd's own (private) helper does: the keyword case-insensitively,
    the rest stripped.
    """
    if arg[: len(keyword)].upper() == keyword:
        return arg[len(keyword) :].strip()
    return None


def parse_mail(arg: str, *, extended: bool, max_size: int) -> tuple[Mailbox | None, MailParams]:
    """The argument of MAIL after ``FROM:``. ``None`` is the null sender."""
    try:
        path, param_text, bracketed = split_path(arg)
    except PathSyntaxError:
        raise Refused(BAD_SENDER_SYNTAX) from None
    if not path and not bracketed:
        raise Refused(MAIL_SYNTAX)
    if param_text.strip() and not extended:
        raise Refused(NO_PARAMETERS_WITH_HELO)
    params = parse_mail_params(param_text, max_size=max_size)
    try:
        sender = parse_mailbox(path, utf8=params.smtputf8)
    except NeedsSMTPUTF8:
        raise Refused(SENDER_NEEDS_SMTPUTF8) from None
    except BadDomain:
        raise Refused(BAD_SENDER_DOMAIN) from None
    except PathSyntaxError:
        raise Refused(BAD_SENDER_SYNTAX) from None
    if sender is not None:
        if not sender.domain:
            raise Refused(SENDER_NOT_FQDN)
        # RFC 5321 C: accept a source route in MAIL and ignore it.
        sender = Mailbox(sender.local, sender.domain)
    return sender, params


def parse_rcpt(arg: str, *, extended: bool, utf8: bool) -> tuple[Mailbox, RcptParams]:
    """The argument of RCPT after ``TO:``. Syntax only; see ``recipient_refusal``."""
    try:
        path, param_text, bracketed = split_path(arg)
        if not path and not bracketed:
            raise Refused(RCPT_SYNTAX)
        recipient = parse_mailbox(path, utf8=utf8)
    except NeedsSMTPUTF8:
        raise Refused(RECIPIENT_NEEDS_SMTPUTF8) from None
    except BadDomain:
        raise Refused(BAD_RECIPIENT_DOMAIN) from None
    except PathSyntaxError:
        raise Refused(BAD_RECIPIENT_SYNTAX) from None
    if recipient is None:
        raise Refused(BAD_RECIPIENT_SYNTAX)
    if param_text.strip() and not extended:
        raise Refused(NO_PARAMETERS_WITH_HELO)
    return recipient, parse_rcpt_params(param_text, utf8=utf8)


# ------------------------------------------------------------------ relay control


@functools.lru_cache(maxsize=4096)
def client_ip(host: str | None) -> IPAddress | None:
    """The client's address from a peername host, IPv4-mapped IPv6 unwrapped.

    Cached: parsing it was a tenth of the ingress's CPU per connection, and
    the same clients come back (the values are immutable)."""
    if not host:
        return None
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@functools.lru_cache(maxsize=4096)
def is_trusted(ip: IPAddress | None, networks: tuple[IPNetwork, ...]) -> bool:
    """May this client relay to any domain (MAILRELAY_RELAY_NETWORKS)?

    Cached as ``client_ip`` is (the same clients come back; a network's
    ``in`` is Python arithmetic on each of them, per connection)."""
    if ip is None:
        return False
    return any(ip.version == net.version and ip in net for net in networks)


def client_key(ip: IPAddress | None) -> str:
    """What the per-client connection limit counts: an IPv4 address, an IPv6 /64.

    One IPv6 host usually holds a whole /64, so counting addresses would not
    limit it at all.
    """
    if ip is None:
        return "unknown"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def recipient_refusal(
    recipient: Mailbox, *, trusted: bool, accepted_domains: frozenset[str]
) -> str | None:
    """The reply refusing this recipient, or None when it is accepted.

    Sender-specified routing is refused before anything else, for every
    client: the relay only ever routes on the domain part.
    """
    if recipient.routes_by_sender:
        return ROUTING_DENIED
    if not recipient.domain:
        return RECIPIENT_NOT_FQDN
    if trusted or recipient.domain_key in accepted_domains:
        return None
    return RELAY_DENIED


# ----------------------------------------------------------------------------
# Every reply the inbound SMTP server sends, by name.
#
# ENHANCEDSTATUSCODES is advertised, so every reply after the greeting (except
# the lines of the EHLO/HELO reply and ``354``) carries an RFC 3463 code.
# Replies aiosmtpd builds itself get one from ``session.enhance``.
# ----------------------------------------------------------------------------


# --- success
OK = "250 2.0.0 Ok"
SENDER_OK = "250 2.1.0 Ok"
RECIPIENT_OK = "250 2.1.5 Ok"
QUEUED = "250 2.0.0 Ok: queued as {qid}"
START_DATA = "354 End data with <CR><LF>.<CR><LF>"
CANNOT_VRFY = "252 2.0.0 Cannot VRFY user, but will accept message and attempt delivery"

# --- command syntax and sequence
MAIL_SYNTAX = "501 5.5.4 Syntax: MAIL FROM:<address> [parameters]"
RCPT_SYNTAX = "501 5.5.4 Syntax: RCPT TO:<address> [parameters]"
HELO_SYNTAX = "501 Syntax: HELO hostname"  # a reply to HELO: no enhanced code
EHLO_SYNTAX = "501 Syntax: EHLO hostname"  # a reply to EHLO: no enhanced code
VRFY_SYNTAX = "501 5.5.4 Syntax: VRFY <address>"
NESTED_MAIL = "503 5.5.1 Error: nested MAIL command"
NEED_MAIL = "503 5.5.1 Error: need MAIL command"
NO_VALID_RECIPIENTS = "554 5.5.1 Error: no valid recipients"
DATA_SYNTAX = "501 5.5.4 Syntax: DATA"
BAD_SENDER_SYNTAX = "553 5.1.7 Bad sender address syntax"
BAD_RECIPIENT_SYNTAX = "553 5.1.3 Bad recipient address syntax"
SENDER_NOT_FQDN = "553 5.1.7 Sender address must be fully qualified (user@domain)"
RECIPIENT_NOT_FQDN = "553 5.1.3 Recipient address must be fully qualified (user@domain)"
SENDER_NEEDS_SMTPUTF8 = "553 5.6.7 Non-ASCII sender address requires SMTPUTF8"
RECIPIENT_NEEDS_SMTPUTF8 = "553 5.6.7 Non-ASCII recipient address requires SMTPUTF8"
UNKNOWN_PARAMETER = "555 5.5.4 Unsupported parameter {name}"
DUPLICATE_PARAMETER = "501 5.5.4 Duplicate parameter {name}"
BAD_PARAMETER = "501 5.5.4 Invalid value for {name}"
PARAMETER_SYNTAX = "501 5.5.4 Bad parameter syntax"
NO_PARAMETERS_WITH_HELO = "501 5.5.4 Parameters need EHLO"

# --- relay control (RFC 5321 3.6, 7.1; nmap smtp-open-relay)
RELAY_DENIED = "554 5.7.1 Relay access denied"
ROUTING_DENIED = "554 5.7.1 Sender-specified routing (%, !, @ or source route) is not relayed"

# --- limits
MESSAGE_TOO_BIG = "552 5.3.4 Message size exceeds fixed maximum message size"
TOO_MANY_RECIPIENTS = "452 4.5.3 Too many recipients"
TOO_MANY_HOPS = "554 5.4.6 Too many hops (Received headers): routing loop"
# Postfix's header_size_limit, and a count of fields (MAILRELAY_SMTP_MAX_HEADER_*)
TOO_MANY_HEADER_FIELDS = "552 5.3.4 Message header has too many header fields (more than {limit})"
HEADER_FIELD_TOO_LONG = "552 5.3.4 Message header field too long (more than {limit} bytes)"

# --- message data (SMTP smuggling, CVE-2023-51764 family)
BARE_LINE_ENDING = "550 5.6.0 Message contains bare CR or LF; lines must end with CRLF"

# --- our side
STORE_FAILED = "451 4.3.0 Error: message not stored; try again later"
INTERNAL_ERROR = "451 4.3.0 Error: internal server error; try again later"
SHUTTING_DOWN = "421 4.3.2 Service shutting down, closing transmission channel"
TIMEOUT = "421 4.4.2 Timeout exceeded, closing transmission channel"

# --- connection and session limits (issue #9; Postfix's anvil and smtpd limits)
TOO_MANY_CONNECTIONS = "421 4.7.0 Too many connections, try again later"
TOO_MANY_FROM_CLIENT = "421 4.7.0 Too many connections from your address, try again later"
SESSION_TOO_LONG = "421 4.4.2 Session time limit exceeded, closing transmission channel"
TOO_MANY_JUNK_COMMANDS = "421 4.7.0 Too many commands without a message, closing channel"
DATA_TOO_SLOW = "421 4.4.2 Data timeout or rate too low, closing transmission channel"
EXPN_DISABLED = "502 5.5.1 EXPN not available"

# --- submission and AUTH (RFC 4954, RFC 3207, RFC 6409, RFC 8314)
STARTTLS_FIRST = "530 5.7.0 Must issue a STARTTLS command first"
AUTH_REQUIRED = "530 5.7.0 Authentication required"
AUTH_OK = "235 2.7.0 Authentication successful"
AUTH_FAILED = "535 5.7.8 Authentication credentials invalid"
AUTH_NEEDS_TLS = "538 5.7.11 Encryption required for requested authentication mechanism"
AUTH_LOCKED_OUT = "421 4.7.0 Too many authentication failures from your address, try again later"
AUTH_ACCOUNT_LOCKED = "454 4.7.0 Too many authentication failures for this account, try later"
AUTH_UNAVAILABLE = "454 4.7.0 Temporary authentication failure, try again later"
AUTH_LINE_TOO_LONG = "500 5.5.6 Authentication Exchange line is too long"  # RFC 4954 4
AUTH_SYNTAX = "501 5.5.4 Syntax: AUTH mechanism [initial-response]"
AUTH_MECHANISM = "504 5.5.4 Unrecognized authentication type (PLAIN and LOGIN are offered)"
AUTH_ALREADY = "503 5.5.1 Error: already authenticated"
AUTH_NEEDS_EHLO = "503 5.5.1 Error: send EHLO first"
AUTH_IN_TRANSACTION = "503 5.5.1 Error: AUTH not permitted during a mail transaction"
AUTH_ABORTED = "501 5.7.0 Authentication aborted"
AUTH_BAD_BASE64 = "501 5.5.2 Cannot decode base64"
AUTH_BAD_PLAIN = "501 5.5.2 Cannot split the PLAIN response (authzid NUL authcid NUL passwd)"
SENDER_NOT_ALLOWED = "553 5.7.1 <{address}>: Sender address not allowed for account {username}"
# reject_sender_login_mismatch, applied to the header: DKIM would vouch for it
HEADER_SENDER_NOT_ALLOWED = (
    "550 5.7.1 <{address}>: {field} header address not allowed for account {username}"
)
ACCOUNT_RATE_LIMITED = (
    "451 4.7.1 Account {username} has sent its {limit} messages this hour, try again later"
)
