"""One form of a domain: IDNA 2008 with UTS #46 mapping.

A recipient's or sender's domain is normalised once, when the message is
accepted (SMTP MAIL/RCPT, pickup, replay), and its one form is what relay
control, the transport map, queue names and DNS see. Without it
``victim@ｅｘａｍｐｌｅ.test`` (full-width letters) would pass relay control for
``example.test`` and then be routed by its raw form, past the transport map.

Mapping and checks (both functions below):

- UTS #46 mapping (non-transitional, as browsers do): upper case to lower
  case, full-width letters and digits to ASCII, the ideographic full stop
  U+3002 and its kin (U+FF0E, U+FF61) to ".", compatibility characters
  ("ﬀ" → "ff") and NFC; a final dot is dropped;
- a non-ASCII label must be a valid IDNA 2008 U-label (RFC 5891-5893:
  allowed code points, no leading combining mark, hyphens, joiners, bidi);
- an A-label given as ASCII (``xn--...``) must be the canonical encoding of
  such a U-label: ``xn--zz`` and ``xn--n3h`` (☃, an IDNA 2003 name that
  IDNA 2008 disallows) have no form and are refused, as the U-label ``☃`` is;
- other ASCII labels keep the host-name syntax the relay always had:
  letters, digits, hyphens inside, and underscores (internal hosts; Postfix
  allows them); the hyphen rules of IDNA apply to IDN labels only;
- at most 63 octets per label and 253 for the name (RFC 1035, in A-labels).

Two spellings of the one form:

- ``domain_key``: lower-case A-labels (``xn--exmple-cua.com``), no final
  dot. ``Recipient.domain``, accepted domains, transport-map keys, queue
  names and DNS use it. Address literals are lower-cased, nothing more.
- ``envelope_domain``: what the stored envelope address carries. An all-ASCII
  domain is kept as given (case and a final dot mean nothing to DNS or a next
  hop; the address stays what the client wrote); any other is replaced by
  its mapped form, with U-labels kept as U-labels (``EXÄMPLE.com`` →
  ``exämple.com``, ``ｅｘａｍｐｌｅ.test`` → ``example.test``), so a message
  needs SMTPUTF8 downstream exactly when its client used it. Address
  literals are kept as given.

This module is a leaf (no models, no settings): ``queues``, ``delivery`` and
``mailrelay.settings`` may all import it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

import idna
from django.core.exceptions import ImproperlyConfigured

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
