"""The store's pure helpers: text, units, domains, retry keys, the NOTIFY rule
and header blocks.

A leaf module (standard library, ``idna``, Django's settings error and
timezone; the NOTIFY rule's query helpers import ``Q`` when called): the
settings (``mailrelay.env``, ``mailrelay.settings``), the store, the viewer,
the engine and the read side all import it, and it imports nothing of the
project, so the dependency arrows run one way. Its parts, each under its own
heading below:

- **text**: the one NUL scrubber, for text from strangers;
- **units**: parsing and formatting durations and sizes;
- **domains**: one form of a domain (IDNA 2008 with UTS #46 mapping);
- **retry keys**: what a retry hint is filed under, bounded for its index;
- **the NOTIFY rule**: who is owed which delivery status notification;
- **headers**: reading the header block of a stored message;
- **the clock**: the one ``clock`` every "now" comes from.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from email.header import decode_header, make_header
from email.utils import getaddresses
from typing import TYPE_CHECKING

import idna
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

if TYPE_CHECKING:
    from django.db.models import Q

# ----------------------------------------------------------------------------
# Text from strangers, made storable: the one NUL scrubber.
#
# PostgreSQL text cannot hold NUL, and a peer's reply, a header or a tracking
# field may carry one. Every writer of such text scrubs it here.
# ----------------------------------------------------------------------------


REPLACEMENT = "\ufffd"


def scrub_nul(text: str, replacement: str = REPLACEMENT) -> str:
    """``text`` without NUL (each replaced by ``replacement``, U+FFFD unless told)."""
    return text.replace("\x00", replacement) if "\x00" in text else text


# ----------------------------------------------------------------------------
# Units: parsing and formatting durations and sizes, and seconds for the clients.
#
# A leaf module (standard library only) like ``queues.lib``: the settings
# (``mailrelay.env``), the queue store, the viewer and ``delivery`` all import
# it, and it imports none of them, so ``queues`` needs nothing from
# ``mailrelay`` and the dependency arrows run one way.
# ----------------------------------------------------------------------------


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1024,
    "M": 1024**2,
    "MB": 1024**2,
    "G": 1024**3,
    "GB": 1024**3,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_DURATION_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
# Exchange's TimeSpan notation: [d.]hh:mm:ss
_TIMESPAN = re.compile(r"^(?:(\d+)\.)?(\d{1,2}):(\d{2}):(\d{2})$")


def parse_size(text: str) -> int:
    """``35MB`` → 36700160; a bare number is bytes. Units are binary (K=1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 35MB, 512K, 1048576)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]


def parse_duration(text: str) -> timedelta:
    """Parse ``90s``, ``15m``, ``2h``, ``2d``, ``1h30m``, or Exchange's ``d.hh:mm:ss``."""
    text = text.strip()
    span = _TIMESPAN.match(text)
    if span:
        days, hours, minutes, seconds = (int(g or 0) for g in span.groups())
        if minutes > 59 or seconds > 59:
            raise ValueError(f"{text!r} is not a duration")
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    if not text:
        raise ValueError("empty duration")
    pos = 0
    total = 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text):
        raise ValueError(f"{text!r} is not a duration (e.g. 90s, 15m, 2h, 2d, 1h30m, 1.00:00:00)")
    return timedelta(seconds=total)


def seconds(value: timedelta | float | int) -> float:
    """``value`` as float seconds: a ``timedelta`` or a number of seconds
    (asyncio and dnspython want a float)."""
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


_ZERO = timedelta(0)
_SECOND = timedelta(seconds=1)
# (seconds, compact label, spaced label), largest first.
_UNITS = ((86400, "d", "d"), (3600, "h", "h"), (60, "m", "min"), (1, "s", "s"))
_SECONDS = len(_UNITS) - 1


def format_duration(value: timedelta, *, units: int | None = None, spaced: bool = False) -> str:
    """A duration as text, in days, hours, minutes and seconds (no weeks).

    Exact by default, in Exim's notation (what ``parse_duration`` reads back):
    ``1d8h15m``, ``7h35m37.5s``, ``0s``, ``-15m``.

    ``units``: rounded down to that many units, counted from the largest that
    is not zero; units that are zero are left out, and seconds are shown only
    under a minute (past it they are noise). ``spaced``: for people, ``3 h 5
    min`` rather than ``3h5m``. The viewer's ages are ``units=2, spaced=True``
    (``45 s``, ``12 min``, ``3 h 5 min``, ``2 d 4 h``); the CLI's ``units=1``.
    """
    if value < _ZERO:
        return "-" + format_duration(-value, units=units, spaced=spaced)
    total = value / _SECOND
    rest = int(total)
    counts = []
    for size, _, _ in _UNITS:
        count, rest = divmod(rest, size)
        counts.append(count)
    first = next((i for i, count in enumerate(counts) if count), _SECONDS)
    if units is None:
        last, fraction = len(_UNITS), total - int(total)
    else:
        last, fraction = min(first + units, max(first + 1, _SECONDS)), 0.0
    parts = []
    for i in range(first, last):
        amount: float = counts[i] + (fraction if i == _SECONDS else 0)
        if amount:
            parts.append(f"{amount:g}" if amount != int(amount) else f"{int(amount)}")
            parts[-1] += " " + _UNITS[i][2] if spaced else _UNITS[i][1]
    if not parts:
        parts.append("0 s" if spaced else "0s")
    return (" " if spaced else "").join(parts)


# ----------------------------------------------------------------------------
# One form of a domain: IDNA 2008 with UTS #46 mapping.
#
# A recipient's or sender's domain is normalised once, when the message is
# accepted (SMTP MAIL/RCPT, pickup, replay), and its one form is what relay
# control, the transport map, queue names and DNS see. Without it
# ``victim@ｅｘａｍｐｌｅ.test`` (full-width letters) would pass relay control for
# ``example.test`` and then be routed by its raw form, past the transport map.
#
# Mapping and checks (both functions below):
#
# - UTS #46 mapping (non-transitional, as browsers do): upper case to lower
#   case, full-width letters and digits to ASCII, the ideographic full stop
#   U+3002 and its kin (U+FF0E, U+FF61) to ".", compatibility characters
#   ("ﬀ" → "ff") and NFC; a final dot is dropped;
# - a non-ASCII label must be a valid IDNA 2008 U-label (RFC 5891-5893:
#   allowed code points, no leading combining mark, hyphens, joiners, bidi);
# - an A-label given as ASCII (``xn--...``) must be the canonical encoding of
#   such a U-label: ``xn--zz`` and ``xn--n3h`` (☃, an IDNA 2003 name that
#   IDNA 2008 disallows) have no form and are refused, as the U-label ``☃`` is;
# - other ASCII labels keep the host-name syntax the relay always had:
#   letters, digits, hyphens inside, and underscores (internal hosts; Postfix
#   allows them); the hyphen rules of IDNA apply to IDN labels only;
# - at most 63 octets per label and 253 for the name (RFC 1035, in A-labels).
#
# Two spellings of the one form:
#
# - ``domain_key``: lower-case A-labels (``xn--exmple-cua.com``), no final
#   dot. ``Recipient.domain``, accepted domains, transport-map keys, queue
#   names and DNS use it. Address literals are lower-cased, nothing more.
# - ``envelope_domain``: what the stored envelope address carries. An all-ASCII
#   domain is kept as given (case and a final dot mean nothing to DNS or a next
#   hop; the address stays what the client wrote); any other is replaced by
#   its mapped form, with U-labels kept as U-labels (``EXÄMPLE.com`` →
#   ``exämple.com``, ``ｅｘａｍｐｌｅ.test`` → ``example.test``), so a message
#   needs SMTPUTF8 downstream exactly when its client used it. Address
#   literals are kept as given.
#
# This module is a leaf (no models, no settings): ``queues``, ``delivery`` and
# ``mailrelay.settings`` may all import it.
# ----------------------------------------------------------------------------


MAX_LABEL_LENGTH = 63
MAX_NAME_LENGTH = 253  # RFC 1035 255 octets on the wire, without the final dot
ACE_PREFIX = "xn--"

# Letters, digits, hyphen inside; underscore too (lower case: applied after mapping).
_ASCII_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?\Z")


class DomainError(ValueError):
    """A domain without a normalised form; the text says why, for a log or a setting."""


def is_address_literal(domain: str) -> bool:
    return domain.startswith("[")


def _label(label: str) -> str:
    """One mapped label in its A-label form, or DomainError."""
    if not label:
        raise DomainError("empty label (two dots in a row, or a leading dot)")
    if label.isascii() and not label.startswith(ACE_PREFIX):
        if not _ASCII_LABEL.match(label):
            raise DomainError(
                f"label {label!r}: letters, digits and hyphens only, "
                "not starting or ending with a hyphen"
            )
    else:
        try:
            # An A-label is decoded and written again: only the canonical
            # encoding of a valid IDNA 2008 U-label comes back unchanged.
            ulabel = idna.ulabel(label) if label.isascii() else label
            alabel = idna.alabel(ulabel).decode("ascii")
        except UnicodeError as exc:  # idna.IDNAError and its kin are UnicodeErrors
            raise DomainError(f"label {label!r} is not valid IDNA 2008 ({exc})") from None
        if label.isascii() and alabel != label:
            raise DomainError(f"label {label!r} is not a canonical A-label")
        label = alabel
    if len(label) > MAX_LABEL_LENGTH:
        raise DomainError(f"label {label!r} is longer than {MAX_LABEL_LENGTH} octets")
    return label


@functools.lru_cache(maxsize=4096)
def _forms(domain: str) -> tuple[str, str]:
    """(mapped form, A-label form) of a name; DomainError when it has none.

    Cached: a relay sees the same few domains over and over (errors are not cached).
    """
    if domain.isascii():
        mapped = domain.lower()  # what UTS #46 mapping does to ASCII
    else:
        try:
            mapped = idna.uts46_remap(domain, std3_rules=False, transitional=False)
        except UnicodeError as exc:
            raise DomainError(str(exc)) from None
    if mapped.endswith("."):
        mapped = mapped[:-1]
    if not mapped:
        raise DomainError("empty domain")
    key = ".".join(_label(label) for label in mapped.split("."))
    if len(key) > MAX_NAME_LENGTH:
        raise DomainError(f"the name is longer than {MAX_NAME_LENGTH} octets (in A-labels)")
    return mapped, key


def domain_key(domain: str) -> str:
    """The key a domain is compared and routed by; DomainError when it has no form.

    ``ｅｘａｍｐｌｅ。ＴＥＳＴ.`` → ``example.test``; ``EXÄMPLE.com`` and
    ``XN--exmple-cua.com`` → ``xn--exmple-cua.com``; ``[IPv6:2001:DB8::1]`` →
    ``[ipv6:2001:db8::1]``.
    """
    if is_address_literal(domain):
        return domain.lower()
    return _forms(domain)[1]


def envelope_domain(domain: str) -> str:
    """The domain as the stored envelope address carries it; DomainError when it
    has no form. ASCII and address literals as given, any other name mapped
    (``ｅｘａｍｐｌｅ。test`` → ``example.test``, ``EXÄMPLE.com`` → ``exämple.com``).
    """
    if is_address_literal(domain):
        return domain
    mapped = _forms(domain)[0]  # checks it, whatever its spelling
    return domain if domain.isascii() else mapped


def domain_keys(setting: str, values: Iterable[str]) -> list[str]:
    """A list setting of domains (MAILRELAY_ACCEPTED_DOMAINS) in their one form.

    A bad entry stops start-up with ImproperlyConfigured naming the setting.
    """
    keys: list[str] = []
    for value in values:
        try:
            key = domain_key(value.strip())
        except DomainError as exc:
            raise ImproperlyConfigured(f"{setting}: {value!r} is not a domain ({exc})") from None
        if key not in keys:
            keys.append(key)
    return keys


# ----------------------------------------------------------------------------
# The keys the store's retry hints are filed under (queues.models.RetryHint;
# Exim's hints database, §3 and §7 of its retry rules): a host error per host
# and IP address, an RCPT 4xx per recipient and sender.
# ----------------------------------------------------------------------------


def normalise_sender(sender: str) -> str:
    """A sender as retry rules match it and address keys hold it: without its
    angle brackets and surrounding blanks ("" is the null sender)."""
    sender = sender.strip()
    if sender.startswith("<") and sender.endswith(">"):
        sender = sender[1:-1].strip()
    return sender


def host_key(host: str, ip: str | None = None, port: int | None = None) -> str:
    """Key for host errors, per IP address as Exim keeps it (§7): ``T:host:ip[:port]``."""
    key = f"T:{host.lower().rstrip('.')}"
    if ip:
        key += f":{ip}"
    if port is not None:
        key += f":{port}"
    return bounded_key(key)


# Keys are stored under a unique btree index (RetryHint.key, varchar(700); an
# index row holds at most 2704 octets) and address keys are made of what
# clients send. A key longer than MAX_KEY_BYTES octets of UTF-8 is stored as
# its head and tail, readable, and the SHA-256 of the whole key: distinct
# keys stay distinct, and every stored key fits. Keys of host names (at most
# 253 octets) and of usual addresses are short enough to stay as they are.
MAX_KEY_BYTES = 400
_KEY_HEAD_BYTES = 200
_KEY_TAIL_BYTES = 120


def bounded_key(key: str) -> str:
    """``key`` itself, or, when it is longer than MAX_KEY_BYTES octets,
    ``<head>...<tail>#<sha256 of the key>``."""
    raw = key.encode("utf-8", "surrogatepass")
    if len(raw) <= MAX_KEY_BYTES:
        return key
    head = raw[:_KEY_HEAD_BYTES].decode("utf-8", "ignore")  # a cut character is dropped
    tail = raw[-_KEY_TAIL_BYTES:].decode("utf-8", "ignore")
    return f"{head}...{tail}#{hashlib.sha256(raw).hexdigest()}"


def address_key(address: str, sender: str | None) -> str:
    """Key for RCPT 4xx errors: the recipient combined with the sender (§3),
    bounded (``bounded_key``): both come from the client.

    ``sender=None`` delays the recipient regardless of sender (Exim's
    ``address_retry_include_sender false``).
    """
    if sender is None:
        return bounded_key(f"R:{address}")
    return bounded_key(f"R:{address}:<{normalise_sender(sender)}>")


# ----------------------------------------------------------------------------
# The NOTIFY rule (RFC 3461), written once: who is owed which report. The DSN
# builder and notifier (queues.bounce), the delivery round (a "relayed" report
# owed on success), the operator's preview of a removal's NDRs (``dsn_wanted_q``,
# the same rule as a query) and the explain page all ask here.
# ----------------------------------------------------------------------------

# Kinds, named after the NOTIFY keywords (RFC 3461 §4.1).
DSN_FAILURE = "failure"
DSN_DELAY = "delay"
DSN_SUCCESS = "success"
DSN_KINDS = (DSN_FAILURE, DSN_DELAY, DSN_SUCCESS)

# Defaults when NOTIFY was not given (RFC 3461 §4.1 leaves it to us; FAILURE,DELAY
# is what Postfix, Exim and Exchange do).
DEFAULT_NOTIFY = frozenset({DSN_FAILURE, DSN_DELAY})


def first_categorization(received_at: datetime, next_attempt_at: datetime) -> bool:
    """Whether a message the categorizer takes is on its first categorization:
    due at its arrival (whatever sends a message back to Submission, or revives
    it, makes it due later). Its ``received`` event goes out then, and its
    recipients have no routing yet."""
    return next_attempt_at == received_at


def null_sender(mail_from: str) -> bool:
    """Reports never go to the null sender (RFC 5321 §4.5.5, RFC 3461 §6.2: a
    report about a report could loop forever)."""
    return mail_from.strip() in ("", "<>")


def dsn_wanted(kind: str, notify: str, mail_from: str) -> bool:
    """Whether a ``kind`` report is owed for a recipient with this NOTIFY value.

    Never to the null sender; NOTIFY=NEVER wants none; no NOTIFY means
    FAILURE,DELAY; otherwise exactly the listed kinds.
    """
    if kind not in DSN_KINDS:
        raise ValueError(f"unknown DSN kind {kind!r}")
    if null_sender(mail_from):
        return False
    keywords = {word.strip().lower() for word in notify.split(",") if word.strip()}
    if not keywords:
        return kind in DEFAULT_NOTIFY
    if "never" in keywords:
        return False
    return kind in keywords


def dsn_wanted_q(kind: str, prefix: str = "") -> Q:
    """``dsn_wanted`` on recipient rows, as a query (``prefix``: the path to the
    recipient, e.g. "recipients__"); the null-sender part is the message's,
    ``null_sender_q``."""
    from django.db.models import Q

    if kind not in DSN_KINDS:
        raise ValueError(f"unknown DSN kind {kind!r}")
    notify = f"{prefix}notify"
    listed = Q(**{f"{notify}__icontains": kind}) & ~Q(**{f"{notify}__icontains": "never"})
    return Q(**{notify: ""}) | listed if kind in DEFAULT_NOTIFY else listed


def null_sender_q(prefix: str = "") -> Q:
    """``null_sender`` on message rows, as a query."""
    from django.db.models import Q

    return Q(**{f"{prefix}mail_from__in": ("", "<>")})


# ----------------------------------------------------------------------------
# Pure helpers for the header block of a stored message.
# ----------------------------------------------------------------------------


# Where the header fields end: at the empty line after them; at a final line
# end or the end of the data when the message is all header; at once when it
# starts with an empty line (no header fields). LF alone counts as a line end.
# ``header_end`` finds it with bytes searches; this is its definition, which
# tests/test_headers.py holds it to.
_HEADER_END = re.compile(rb"\A\r?\n|\r?\n\r?\n|\r?\n\Z")
# The fields inspect_headers reads, with their continuation lines; a
# continuation line starts with a blank, so it never matches a field name.
_WANTED_FIELD = re.compile(
    rb"^(message-id|subject|received)[ \t]*:([^\n]*(?:\n[ \t][^\n]*)*)",
    re.IGNORECASE | re.MULTILINE,
)
# The fields that say who wrote a message (RFC 5322 3.6.2), with their continuations.
_AUTHOR_FIELD = re.compile(
    rb"^(from|sender)[ \t]*:([^\n]*(?:\n[ \t][^\n]*)*)", re.IGNORECASE | re.MULTILINE
)
# Where a header field ends and the next begins: a CRLF not followed by a blank.
_FIELD_BREAK = re.compile(rb"\r\n(?![ \t])")


@dataclass(frozen=True)
class HeaderInfo:
    message_id: str
    subject: str
    received_count: int
    header_bytes: int


def header_end(data: bytes | bytearray) -> int:
    """The length of the header block of ``data``: its fields, without the line
    end of the last one (all of ``data`` when it has neither an empty line nor
    a final line end). The one place a message is split into header and body."""
    # What _HEADER_END finds, with bytes searches (a regular expression tries
    # its alternatives at every byte of the header: several times the CPU).
    if data[:1] == b"\n" or data[:2] == b"\r\n":
        return 0  # no header fields
    # The first line end followed by another: "\n\r\n" or "\n\n" (a CRLF header
    # ends at a "\n\r\n", so "\n\n" is looked for only before it).
    crlf = data.find(b"\n\r\n")
    lf = data.find(b"\n\n", 0, len(data) if crlf < 0 else crlf + 1)
    at = crlf if lf < 0 else lf
    if at < 0:
        # no empty line: the header ends at a final line end, or with the data
        if data[-1:] == b"\n":
            return len(data) - (2 if data[-2:] == b"\r\n" else 1)
        return len(data)
    return at - 1 if at and data[at - 1] == 13 else at  # 13: its CR


def header_block(data: bytes) -> bytes:
    """The header fields of ``data``, without the line end of the last one."""
    return data[: header_end(data)]


def _decode_words(value: str) -> str:
    if "=?" not in value:
        return value
    try:
        return str(make_header(decode_header(value)))
    except Exception:  # noqa: BLE001 - a malformed encoded word is shown as-is
        return value


def _wanted_fields(data: bytes | bytearray, end: int) -> Iterator[tuple[str, str]]:
    """(lower-case name, unfolded value) of the fields inspect_headers needs.

    Scans ``data`` up to ``end`` in place: a message may be all header (no
    empty line), and neither the block nor its lines are copied.
    """
    for match in _WANTED_FIELD.finditer(data, 0, end):
        first, *rest = match.group(2).split(b"\n")
        value = first.rstrip(b"\r").strip().decode("utf-8", "replace")
        for line in rest:
            value += " " + line.rstrip(b"\r").strip().decode("utf-8", "replace")
        yield match.group(1).decode("ascii").lower(), value


def inspect_headers(data: bytes | bytearray) -> HeaderInfo:
    """Copy out what the queue store filters on: Message-ID, Subject, hop count."""
    end = header_end(data)
    message_id = subject = ""
    received = 0
    for name, value in _wanted_fields(data, end):
        if name == "message-id" and not message_id:
            message_id = value[:998]
        elif name == "subject" and not subject:
            subject = _decode_words(value)[:998]
        elif name == "received":
            received += 1
    # Copied into text columns: PostgreSQL text cannot hold NUL.
    return HeaderInfo(scrub_nul(message_id, ""), scrub_nul(subject, ""), received, end)


def author_addresses(data: bytes | bytearray) -> list[tuple[str, str]]:
    """(field name, address) for every address of every From and Sender field
    of the header block, as ``getaddresses`` reads them (the same reading that
    picks the DKIM signing domain, ``queues.dkim.from_domain``). An empty
    address (``From: <>``, a group with no members) claims nothing and is left out."""
    found = []
    for match in _AUTHOR_FIELD.finditer(data, 0, header_end(data)):
        value = b" ".join(line.strip() for line in match.group(2).split(b"\n"))
        name = match.group(1).decode("ascii").capitalize()
        for _display, address in getaddresses([value.decode("utf-8", "replace")]):
            if address:
                found.append((name, address))
    return found


def header_shape_refusal(
    data: bytes | bytearray, max_fields: int, max_field_size: int
) -> tuple[str, int] | None:
    """("fields", limit) when the header block has more than ``max_fields``
    fields, ("size", limit) when one field (its folded lines together, without
    its final CRLF) is longer than ``max_field_size`` bytes; else None (0 = no
    limit). Read in place, in one pass that stops at the first excess; a usual
    header (fewer lines than the field limit, shorter than the size limit)
    costs one count of its line ends."""
    end = header_end(data)
    if not end:
        return None
    lines = data.count(b"\n", 0, end) + 1
    if (not max_fields or lines <= max_fields) and (not max_field_size or end <= max_field_size):
        return None
    fields, start = 1, 0
    for match in _FIELD_BREAK.finditer(data, 0, end):
        if max_field_size and match.start() - start > max_field_size:
            return "size", max_field_size
        fields, start = fields + 1, match.end()
        if max_fields and fields > max_fields:
            return "fields", max_fields
    if max_field_size and end - start > max_field_size:
        return "size", max_field_size
    return None


# ----------------------------------------------------------------------------
# The one clock. Every "now" in mailrelay comes from here so tests can move
# time.
#
# Retry schedules span days; tests move this clock instead of sleeping. The
# offset is process-local: code that runs in other processes (a real Celery
# worker) sees real time.
# ----------------------------------------------------------------------------


class Clock:
    """``clock.now()`` is Django's aware now, moved by what tests ``advance``."""

    def __init__(self) -> None:
        self._offset = timedelta(0)

    def now(self) -> datetime:
        return timezone.now() + self._offset

    def advance(self, delta: timedelta) -> None:
        """Move the clock forward (tests only)."""
        self._offset += delta

    def reset(self) -> None:
        self._offset = timedelta(0)


clock = Clock()
