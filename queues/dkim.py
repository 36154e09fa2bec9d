"""DKIM (RFC 6376; Ed25519 per RFC 8463) with dkimpy: the keys and the signature.

The accept decides whether a message is signed and with which key
(``queues.accept.sign_message``, from the process's ``KeyStore`` there): when
the message's From domain (or a parent of it, which DMARC's relaxed alignment
accepts), else the configured ``MAILRELAY_DKIM_SIGNING_DOMAIN``, has a key, it
calls ``sign`` here with the bytes it is about to store (our prefix and the
received data); the answer is a ``DKIM-Signature`` header field, stored apart
in ``Message.signature`` and sent in front of the stored bytes. The stored
bytes are never changed. Without a key nothing here runs for a message.

Keys come from ``MAILRELAY_DKIM_KEYS_DIR`` (files ``<domain>.<selector>.key``)
and from the database (``DkimKey``, enabled ones); a database key wins over a
file for the same domain, and among several the newest wins (``load_keys``).
The accept's ``KeyStore`` loads them once and keeps them, reloaded at most
every ``MAILRELAY_DKIM_KEY_REFRESH``, so a message costs no file read and no
query.

The crypto is dkimpy's (with PyNaCl for Ed25519); ``cryptography`` only
generates keys and converts key files into the forms dkimpy reads.
"""

from __future__ import annotations

import base64
import functools
import logging
import re
from dataclasses import dataclass
from email.utils import getaddresses
from pathlib import Path

import dkim
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa, utils
from django.db import InterfaceError, OperationalError, connection, transaction

from queues import lib
from queues.config import store_settings
from queues.database import is_outage
from queues.lib import header_end

log = logging.getLogger(__name__)

RSA_SHA256 = "rsa-sha256"
ED25519_SHA256 = "ed25519-sha256"
ALGORITHMS = (RSA_SHA256, ED25519_SHA256)
RSA_BITS = 2048
KEY_SUFFIX = ".key"
_CANONICALIZE = (b"relaxed", b"relaxed")
# The From field and its continuation lines (a continuation starts with a blank).
_FROM_FIELD = re.compile(rb"^from[ \t]*:([^\n]*(?:\n[ \t][^\n]*)*)", re.IGNORECASE | re.MULTILINE)
_LINE_END = re.compile(rb"\r?\n")
_SELECTOR = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


class DkimError(Exception):
    """A key that cannot be used, or a message that cannot be signed."""


@dataclass(frozen=True)
class SigningKey:
    domain: str  # the d= domain, in its A-label form
    selector: str  # the s= selector
    algorithm: str  # rsa-sha256 / ed25519-sha256
    private_key: bytes  # as dkimpy takes it: PKCS#1 PEM (RSA) or a base64 seed (Ed25519)
    source: str  # "database" or the file's path, for messages about it
    created: float = 0.0  # when it was made (newest wins), seconds since the epoch


# --- keys: their forms, generation and DNS records ---


def normalize_private_key(text: bytes | str) -> tuple[str, bytes]:
    """(algorithm, the key as dkimpy takes it) for a PEM key (PKCS#1 or PKCS#8,
    RSA or Ed25519) or a base64 Ed25519 seed (what dkimpy's dknewkey writes).

    Raises DkimError for anything else, or an RSA key under 1024 bits (RFC 8301)."""
    raw = text.encode("ascii", "replace") if isinstance(text, str) else bytes(text)
    raw = raw.strip()
    if raw.startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(raw, password=None)
        except (ValueError, TypeError) as exc:
            raise DkimError(f"unreadable PEM private key ({exc})") from None
        if isinstance(key, rsa.RSAPrivateKey):
            if key.key_size < 1024:
                raise DkimError(f"RSA key of {key.key_size} bits: RFC 8301 needs 1024 or more")
            pem = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,  # PKCS#1, dkimpy's own form
                serialization.NoEncryption(),
            )
            return RSA_SHA256, pem
        if isinstance(key, ed25519.Ed25519PrivateKey):
            seed = key.private_bytes(
                serialization.Encoding.Raw,
                serialization.PrivateFormat.Raw,
                serialization.NoEncryption(),
            )
            return ED25519_SHA256, base64.b64encode(seed)
        raise DkimError(f"a {type(key).__name__}: DKIM signs with RSA or Ed25519 keys only")
    try:
        seed = base64.b64decode(raw, validate=True)
    except ValueError:
        seed = b""
    if len(seed) != 32:
        raise DkimError("neither a PEM private key nor a base64 Ed25519 seed of 32 octets")
    return ED25519_SHA256, base64.b64encode(seed)


def generate_private_key(algorithm: str = RSA_SHA256) -> bytes:
    """A new private key in the form files and ``DkimKey.private_key`` keep:
    PKCS#8 PEM for RSA (2048 bits), the base64 seed for Ed25519."""
    if algorithm == RSA_SHA256:
        key = rsa.generate_private_key(public_exponent=65537, key_size=RSA_BITS)
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    if algorithm == ED25519_SHA256:
        seed = ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return base64.b64encode(seed) + b"\n"
    raise DkimError(f"unknown algorithm {algorithm!r} ({' or '.join(ALGORITHMS)})")


def dns_record(private_key: bytes | str) -> str:
    """The TXT record to publish at ``<selector>._domainkey.<domain>``:
    ``v=DKIM1; k=rsa; p=<SubjectPublicKeyInfo>`` or, for Ed25519 (RFC 8463),
    ``v=DKIM1; k=ed25519; p=<the 32-octet public key>``."""
    algorithm, key = normalize_private_key(private_key)
    if algorithm == RSA_SHA256:
        public = serialization.load_pem_private_key(key, password=None).public_key()
        der = public.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return f"v=DKIM1; k=rsa; p={base64.b64encode(der).decode('ascii')}"
    private = ed25519.Ed25519PrivateKey.from_private_bytes(base64.b64decode(key))
    raw = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return f"v=DKIM1; k=ed25519; p={base64.b64encode(raw).decode('ascii')}"


def key_file_name(domain: str, selector: str) -> str:
    return f"{domain}.{selector}{KEY_SUFFIX}"


def check_selector(selector: str) -> str:
    """The selector in lower case; DkimError when it is not a DNS name's labels."""
    value = selector.strip().lower()
    if not _SELECTOR.match(value) or len(value) > 63:
        raise DkimError(f"selector {selector!r} is not made of DNS labels")
    return value


def _file_key(path: Path) -> SigningKey | None:
    """The key a ``<domain>.<selector>.key`` file holds; None (logged) when the
    name or the content is not one. The selector is the name's last label,
    so a selector with dots cannot come from a file (use the database)."""
    stem = path.name[: -len(KEY_SUFFIX)]
    domain, _, selector = stem.rpartition(".")
    try:
        domain = lib.domain_key(domain)
        selector = check_selector(selector)
        algorithm, key = normalize_private_key(path.read_bytes())
        created = path.stat().st_mtime
    except (OSError, DkimError, lib.DomainError) as exc:
        log.warning("DKIM key file %s ignored: %s", path, exc)
        return None
    if "." not in domain:
        log.warning("DKIM key file %s ignored: name it <domain>.<selector>.key", path)
        return None
    return SigningKey(domain, selector, algorithm, key, str(path), created)


def _database_keys() -> list[SigningKey]:
    from queues.models import DkimKey  # the models import this module's users

    keys = []
    # A savepoint when the caller is in a transaction (a DSN made inside one):
    # a failing read must not break it.
    with transaction.atomic():
        rows = list(
            DkimKey.objects.filter(enabled=True).values_list(
                "domain", "selector", "algorithm", "private_key", "created_at"
            )
        )
    for domain, selector, algorithm, private_key, created_at in rows:
        try:
            domain = lib.domain_key(domain)
            kind, key = normalize_private_key(private_key)
        except (DkimError, lib.DomainError) as exc:
            log.warning("DKIM key %s._domainkey.%s ignored: %s", selector, domain, exc)
            continue
        if algorithm and algorithm != kind:
            log.warning(
                "DKIM key %s._domainkey.%s says %s but holds an %s key; signing with %s",
                selector,
                domain,
                algorithm,
                kind,
                kind,
            )
        keys.append(SigningKey(domain, selector, kind, key, "database", created_at.timestamp()))
    return keys


def load_keys(keys_dir: str = "", use_database: bool = True) -> dict[str, SigningKey]:
    """Every usable key by domain: for a domain with several, a database key
    before a file, then the newest."""
    found: list[SigningKey] = []
    if keys_dir:
        folder = Path(keys_dir)
        try:
            paths = sorted(folder.glob(f"*{KEY_SUFFIX}"))
        except OSError as exc:
            log.warning("DKIM keys folder %s unreadable: %s", folder, exc)
            paths = []
        found += [key for path in paths if (key := _file_key(path)) is not None]
    if use_database:
        found += _database_keys()
    by_domain: dict[str, SigningKey] = {}
    for key in sorted(found, key=lambda k: (k.source == "database", k.created)):
        by_domain[key.domain] = key  # the last (best) one stays
    return by_domain


def load_keys_reconnecting(keys_dir: str) -> dict[str, SigningKey]:
    """``load_keys``, once more on a new connection when the thread's one died
    since its last use (a database restart), as ``message_accept`` does: the
    first message after a restart is signed too."""
    try:
        return load_keys(keys_dir)
    except (OperationalError, InterfaceError) as exc:
        if not is_outage(exc) or connection.in_atomic_block or connection.vendor != "postgresql":
            raise
        connection.close()
        return load_keys(keys_dir)


# --- signing ---


def from_domain(data: bytes | bytearray, end: int | None = None) -> str | None:
    """The domain of the (first) From address in the header block ``data[:end]``
    (read in place), in A-label form; None without one."""
    match = _FROM_FIELD.search(data, 0, len(data) if end is None else end)
    if match is None:
        return None
    value = b" ".join(line.strip() for line in match.group(1).split(b"\n"))
    addresses = getaddresses([value.decode("utf-8", "replace")])
    for _name, address in addresses:
        domain = address.rpartition("@")[2]
        if domain:
            try:
                return lib.domain_key(domain)
            except lib.DomainError:
                return None
    return None


# --- the RSA private-key operation, by OpenSSL ---
#
# dkimpy does DKIM (canonicalization, hashes, the header field) and its RSA
# signature in pure Python: a 2048-bit signature is two ``pow`` calls taking
# ~7 ms with the GIL held, which stalls the ingress's event loop and caps an
# ingress process near 100 signed msg/s. PKCS#1 v1.5 is deterministic, so
# OpenSSL (through ``cryptography``) makes the very same bytes in ~0.25 ms:
# dkimpy's signing function is replaced by one that does it there
# (tests/test_dkim.py checks the two agree), and its parse of the key is kept.
# dkimpy still builds everything else.

_dkimpy_rsa_sign = getattr(dkim, "RSASSA_PKCS1_v1_5_sign", None)
_openssl_keys: dict[int, rsa.RSAPrivateKey] = {}  # by modulus: built once per key


def _openssl_key(pk: dict) -> rsa.RSAPrivateKey:
    key = _openssl_keys.get(pk["modulus"])
    if key is None:
        public = rsa.RSAPublicNumbers(pk["publicExponent"], pk["modulus"])
        numbers = rsa.RSAPrivateNumbers(
            p=pk["prime1"],
            q=pk["prime2"],
            d=pk["privateExponent"],
            dmp1=pk["exponent1"],
            dmq1=pk["exponent2"],
            iqmp=pk["coefficient"],
            public_numbers=public,
        )
        key = numbers.private_key()
        if len(_openssl_keys) >= 256:  # keys replaced over a long life: start again
            _openssl_keys.clear()
        _openssl_keys[pk["modulus"]] = key
    return key


def openssl_rsa_sign(hash, private_key: dict) -> bytes:  # noqa: A002 - dkimpy's signature
    """``dkim.crypto.RSASSA_PKCS1_v1_5_sign`` (a hash object, dkimpy's parsed
    key) by OpenSSL: the same signature octets."""
    if hash.name != "sha256":
        return _dkimpy_rsa_sign(hash, private_key)  # rsa-sha1: never made here
    key = _openssl_key(private_key)
    return key.sign(hash.digest(), padding.PKCS1v15(), utils.Prehashed(hashes.SHA256()))


_dkimpy_parse_pem = getattr(dkim, "parse_pem_private_key", None)


@functools.lru_cache(maxsize=256)
def parsed_pem_private_key(data: bytes) -> dict:
    """dkimpy's own parse of a PEM key, once per key instead of once per message
    (its ASN.1 parser is Python too: ~0.3 ms). dkimpy only reads the result."""
    return _dkimpy_parse_pem(data)


if _dkimpy_rsa_sign is not None and _dkimpy_parse_pem is not None:
    dkim.RSASSA_PKCS1_v1_5_sign = openssl_rsa_sign
    dkim.parse_pem_private_key = parsed_pem_private_key


@functools.lru_cache(maxsize=4)
def _include_headers(names: tuple[str, ...]) -> list[bytes] | None:
    """MAILRELAY_DKIM_HEADERS as dkimpy takes it (None: the usual set, see
    ``_usual_headers``), with From added and the fields RFC 6376 says not to
    sign dropped (logged once)."""
    if not names:
        return None
    include = []
    for name in names:
        field = name.strip().lower().encode("ascii", "replace")
        if field in dkim.DKIM.SHOULD_NOT:
            log.warning("MAILRELAY_DKIM_HEADERS: %s is never signed (RFC 6376 5.4.1)", name)
        elif field and field not in include:
            include.append(field)
    if b"from" not in include:
        include.append(b"from")
    return include


_USUAL = frozenset(dkim.DKIM.SHOULD) | frozenset(dkim.DKIM.FROZEN)


def _usual_headers(fields: list[tuple[bytes, bytes]]) -> list[bytes]:
    """RFC 6376's usual fields that the message has (From, To, Cc, Subject,
    Date, Message-ID, MIME and list fields...), each named ONCE in the order
    they first appear, From once more so none can be added. dkimpy's own
    default names a field as often as it occurs: a message of 100,000 To
    fields made an ``h=`` of 100,000 names, folded in quadratic time."""
    include: list[bytes] = []
    seen: set[bytes] = set()
    for name, _value in fields:
        lower = name.lower()
        if lower in _USUAL and lower not in seen:
            seen.add(lower)
            include.append(lower)
    return include + [name for name in include if name in dkim.DKIM.FROZEN]


_FIELD_NAME = re.compile(rb"([\x21-\x7e]+?):")  # dkimpy's (rfc822_parse)
_FIELD_BREAK = re.compile(rb"\r?\n(?![ \t])")  # a line end not followed by a continuation


def _fields(header: bytes) -> list[tuple[bytes, bytes]]:
    """(name, value) of each field of a header block, split as dkimpy's
    ``rfc822_parse`` splits it, but in linear time (it appended each
    continuation line to the value: a copy of the value per line) and with
    one regular-expression split instead of a Python step per line. A value
    keeps its inner line ends as they are and has no final one."""
    fields = []
    for field in _FIELD_BREAK.split(header):
        if not field:
            continue  # after the last field's line end
        match = _FIELD_NAME.match(field)
        if match is not None:
            fields.append((match.group(1), field[match.end() :]))
        elif field[:1] in (b" ", b"\t"):
            raise DkimError("the header starts with a continuation line")
        elif not (field.startswith(b"From ") and b"\n" not in field):
            raise DkimError(f"not a header field: {field[:80]!r}")
        # else an mbox "From " line, skipped as dkimpy skips it
    return fields


def _to_sign(fields: list[tuple[bytes, bytes]], include: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The fields dkimpy will sign, in dkimpy's form (value ending in CRLF,
    inner line ends CRLF): for a name listed k times in ``include``, its last
    k occurrences (RFC 6376 5.4.2; dkimpy's ``select_headers`` picks those).
    The rest would only be canonicalized and never hashed: left out."""
    wanted = {name: include.count(name) for name in set(include)}
    kept = []
    for name, value in reversed(fields):
        lower = name.lower()
        if wanted.get(lower):
            wanted[lower] -= 1
            if value.count(b"\n") != value.count(b"\r\n"):
                value = _LINE_END.sub(b"\r\n", value)
            kept.append((name, value + b"\r\n"))
    kept.reverse()
    return kept


def _split(data: bytes | bytearray) -> tuple[bytes, bytes]:
    """(header fields, each with its line end; body) of ``data``, as dkimpy's
    ``rfc822_parse`` splits a message, without cutting the body into lines:
    that parse holds a 30 MB body about four times over (a list of its lines,
    then their join), this one once."""
    end = header_end(data)
    header = bytes(data[:end]) + b"\r\n" if end else b""
    line_end = _LINE_END.match(data, end)  # ends the last field, or is the empty first line
    start = line_end.end() if line_end else end
    if end and (blank := _LINE_END.match(data, start)) is not None:
        start = blank.end()
    body = bytes(memoryview(data)[start:])
    if body.count(b"\n") != body.count(b"\r\n"):
        body = _LINE_END.sub(b"\r\n", body)  # bare LFs: as rfc822_parse makes them
    return header, body


def sign(data: bytes | bytearray, key: SigningKey, prefix: bytes = b"") -> bytes:
    """The DKIM-Signature header field (ending in a line end) of the message
    ``prefix + data`` by ``key``: relaxed/relaxed, over ``MAILRELAY_DKIM_HEADERS``
    or the usual set (``_usual_headers``), each field name once.

    Its cost is linear in the message: the header is parsed here
    (``_fields``), and only the fields signed are handed to dkimpy."""
    header, body = _split(data)
    header = prefix + header
    fields = _fields(header)
    include = _include_headers(store_settings().dkim_headers) or _usual_headers(fields)
    signer = dkim.DKIM(linesep=b"\r\n" if b"\r\n" in header else b"\n")
    # What dkimpy's parse of the whole message would have set, less the
    # fields it would only canonicalize and never sign.
    signer.headers = _to_sign(fields, include)
    signer.body = body
    try:
        return signer.sign(
            key.selector.encode("ascii"),
            key.domain.encode("ascii"),
            key.private_key,
            signature_algorithm=key.algorithm.encode("ascii"),
            canonicalize=_CANONICALIZE,
            include_headers=include,
        )
    except dkim.DKIMException as exc:
        raise DkimError(f"signing as {key.selector}._domainkey.{key.domain}: {exc}") from exc
