"""SMTP accounts (submission with AUTH): create, list, change, authenticate, limit.

Accounts are mailrelay's own (``SmtpAccount``); passwords are hashed with
Django's hashers and never returned, shown or logged. Every function here is
synchronous ORM: the SMTP server calls ``authenticate``, ``rate_limited`` and
``record_auth_failure`` in its database threads (a hash check costs
milliseconds and must not block the event loop).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth.hashers import check_password, make_password
from django.db import transaction
from django.db.models import QuerySet

from queues import lib
from queues.lib import clock
from queues.models import Event, EventLevel, Message, SmtpAccount

log = logging.getLogger(__name__)

MAX_USERNAME_LENGTH = 150
RATE_WINDOW = timedelta(hours=1)

# Successful logins, remembered so that a client opening a session per message
# does not pay a password hash (~0.3 s of CPU with Django's default PBKDF2) each
# time, as Dovecot's auth cache does. Key: the username and an HMAC of the
# password under a key that lives only in this process; value: the stored hash
# that password was verified against. A changed password changes the stored
# hash, so an entry never outlives it; enabled and senders are read fresh.
_VERIFIED: OrderedDict[tuple[str, bytes], str] = OrderedDict()
_VERIFIED_MAX = 1024
_VERIFIED_KEY = secrets.token_bytes(32)
_verified_lock = threading.Lock()  # the SMTP server's database threads share it


class AccountError(ValueError):
    """A request to create or change an account that cannot be done; the text says why."""


@dataclass(frozen=True)
class Grant:
    """What an authenticated SMTP session may do: the account, without its password."""

    username: str
    allowed_senders: tuple[str, ...]
    max_messages_per_hour: int | None

    def may_send_as(self, address: str) -> bool:
        return sender_allowed(self.allowed_senders, address)


# ----------------------------------------------------------------- validation


def clean_username(username: str) -> str:
    username = (username or "").strip()
    if not username:
        raise AccountError("a username is required")
    if len(username) > MAX_USERNAME_LENGTH:
        raise AccountError(f"a username has at most {MAX_USERNAME_LENGTH} characters")
    if any(not ch.isprintable() or ch.isspace() or ch == "/" for ch in username):
        raise AccountError("a username has no spaces, slashes or control characters")
    return username


def clean_password(password: str) -> str:
    if not password:
        raise AccountError("a password is required")
    if "\x00" in password:
        raise AccountError("a password cannot contain NUL (AUTH PLAIN separates with it)")
    return password


def clean_sender(entry: str) -> str:
    """One allowed sender: ``user@example.com`` (that address) or ``example.com``
    / ``@example.com`` (any address at that domain); stored in lower case, the
    domain in its A-label form."""
    entry = (entry or "").strip()
    local, at, domain = entry.rpartition("@")
    if not domain:
        raise AccountError(f"{entry!r} is neither an address nor a domain")
    try:
        domain = lib.domain_key(domain)
    except lib.DomainError as exc:
        raise AccountError(f"{entry!r}: {exc}") from None
    return f"{local.lower()}@{domain}" if local else domain


def clean_senders(entries: list[str] | tuple[str, ...] | str) -> list[str]:
    if isinstance(entries, str):
        entries = entries.replace(",", " ").split()
    cleaned: list[str] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise AccountError("allowed senders are strings")
        value = clean_sender(entry)
        if value not in cleaned:
            cleaned.append(value)
    return cleaned


def clean_rate(value: int | str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        rate = int(value)
    except (TypeError, ValueError):
        raise AccountError("max_messages_per_hour is a whole number") from None
    if rate < 0:
        raise AccountError("max_messages_per_hour cannot be negative")
    return rate or None  # 0 = no limit


def sender_allowed(allowed: tuple[str, ...] | list[str], address: str) -> bool:
    """May an account with these allowed senders use ``address`` as MAIL FROM?

    The null sender (``<>``, a bounce the client generates) is allowed: it
    claims no address. An empty list allows nothing else.
    """
    if not address:
        return True
    local, _, domain = address.rpartition("@")
    if not local:
        return False
    try:
        domain = lib.domain_key(domain)
    except lib.DomainError:
        return False
    return domain in allowed or f"{local.lower()}@{domain}" in allowed


# ----------------------------------------------------------------- management


def create_account(
    username: str,
    password: str,
    *,
    allowed_senders: list[str] | tuple[str, ...] | str = (),
    max_messages_per_hour: int | str | None = None,
    enabled: bool = True,
) -> SmtpAccount:
    username = clean_username(username)
    senders = clean_senders(allowed_senders)
    rate = clean_rate(max_messages_per_hour)
    hashed = make_password(clean_password(password))
    with transaction.atomic():
        if SmtpAccount.objects.filter(username=username).exists():
            raise AccountError(f"account {username!r} exists already")
        return SmtpAccount.objects.create(
            username=username,
            password=hashed,
            enabled=enabled,
            allowed_senders=senders,
            max_messages_per_hour=rate,
            created_at=clock.now(),
        )


def list_accounts() -> QuerySet[SmtpAccount]:
    return SmtpAccount.objects.order_by("username")


def get_account(username: str) -> SmtpAccount:
    try:
        return SmtpAccount.objects.get(username=username)
    except SmtpAccount.DoesNotExist:
        raise AccountError(f"no account {username!r}") from None


def update_account(
    username: str,
    *,
    allowed_senders: list[str] | tuple[str, ...] | str | None = None,
    max_messages_per_hour: int | str | None | bool = False,
    enabled: bool | None = None,
) -> SmtpAccount:
    """Change what is given (``max_messages_per_hour=False``: unchanged; None: no limit)."""
    account = get_account(username)
    if allowed_senders is not None:
        account.allowed_senders = clean_senders(allowed_senders)
    if max_messages_per_hour is not False:
        account.max_messages_per_hour = clean_rate(max_messages_per_hour)  # type: ignore[arg-type]
    if enabled is not None:
        account.enabled = enabled
    account.save(update_fields=["allowed_senders", "max_messages_per_hour", "enabled"])
    return account


def set_password(username: str, password: str) -> SmtpAccount:
    account = get_account(username)
    account.password = make_password(clean_password(password))
    account.save(update_fields=["password"])
    return account


def set_enabled(username: str, enabled: bool) -> SmtpAccount:
    account = get_account(username)
    account.enabled = enabled
    account.save(update_fields=["enabled"])
    return account


def delete_account(username: str) -> None:
    get_account(username).delete()


def account_summary(account: SmtpAccount) -> dict:
    """What the API and CLI show of an account: never the password or its hash."""
    return {
        "username": account.username,
        "enabled": account.enabled,
        "allowed_senders": list(account.allowed_senders or []),
        "max_messages_per_hour": account.max_messages_per_hour,
        "created_at": account.created_at.isoformat() if account.created_at else None,
        "last_login_at": account.last_login_at.isoformat() if account.last_login_at else None,
    }


# ----------------------------------------------------------------- SMTP AUTH (database threads)


def authenticate(username: str, password: str) -> Grant | None:
    """The account's grant if the username and password match an enabled account.

    Unknown and disabled accounts cost one hash check too (no enumeration by timing).
    """
    account = SmtpAccount.objects.filter(username=username).first() if username else None
    if account is None:
        make_password(password)  # one hash run, as a check costs (Django's ModelBackend)
        return None
    if not account.enabled:
        # Never the cache of verified passwords: its quick answer would tell a
        # disabled account's right password from a wrong one. A full check, as
        # a wrong password costs, and never a success.
        check_password(password, account.password)
        return None
    if not _password_matches(account, password):
        return None
    SmtpAccount.objects.filter(pk=account.pk).update(last_login_at=clock.now())
    return Grant(
        username=account.username,
        allowed_senders=tuple(account.allowed_senders or ()),
        max_messages_per_hour=account.max_messages_per_hour,
    )


def _password_matches(account: SmtpAccount, password: str) -> bool:
    fingerprint = hmac.new(
        _VERIFIED_KEY,
        account.username.encode("utf-8", "surrogatepass")
        + b"\0"
        + password.encode("utf-8", "surrogatepass"),
        hashlib.sha256,
    ).digest()
    key = (account.username, fingerprint)
    with _verified_lock:
        verified = _VERIFIED.get(key)
    if verified is not None and hmac.compare_digest(verified, account.password):
        return True
    if not check_password(password, account.password):
        return False
    with _verified_lock:
        _VERIFIED[key] = account.password
        _VERIFIED.move_to_end(key)
        while len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.popitem(last=False)
    return True


def rate_limited(grant: Grant) -> bool:
    """Has the account sent its ``max_messages_per_hour`` in the last hour?"""
    limit = grant.max_messages_per_hour
    if not limit:
        return False
    since = clock.now() - RATE_WINDOW
    sent = Message.objects.filter(auth_account=grant.username, received_at__gte=since)
    return sent[:limit].count() >= limit


def record_auth_failure(
    client_address: str | None,
    username: str,
    mechanism: str,
    *,
    locked_out: bool,
    locked: str = "address",
) -> None:
    """An Event for one failed AUTH (the password is never recorded); ``locked``:
    what this failure locked ("address" or "user name"), when ``locked_out``."""
    shown = "".join(ch if ch.isprintable() else "?" for ch in username)[:MAX_USERNAME_LENGTH]
    text = f"SMTP AUTH {mechanism} failed for {shown!r} from {client_address or 'unknown'}"
    if locked_out:
        what = "the account" if locked == "user name" else "the address"
        text += f"; too many failures: {what} is refused for a while"
    Event.objects.create(
        created_at=clock.now(),
        level=EventLevel.WARNING,
        kind="smtp_auth_failed",
        text=text,
        data={
            "client_address": client_address,
            "username": shown,
            "mechanism": mechanism,
            "locked_out": locked_out,
            "locked": locked if locked_out else None,
        },
    )


def audit(actor, via: str, action: str, username: str, detail: str = "") -> None:
    """An audit-log entry for an account change (``smtp_account_*``); never a password."""
    from queues.services.actions import _audit  # the one writer of AuditEntry rows

    _audit(
        actor,
        via,
        f"smtp_account_{action}",
        "smtp_account",
        count=1,
        detail=(f"{username}: {detail}" if detail else username),
    )
