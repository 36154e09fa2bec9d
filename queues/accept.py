"""message_accept: the one way a message enters the queue store (Postfix's
cleanup): the queue id, the Received: field, the DKIM signature when a key
applies (which key: the process's ``KeyStore`` here; the keys and the crypto:
``queues.dkim``), and one INSERT of the message and its recipients."""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from email.utils import format_datetime

from django.db import Error, IntegrityError, InterfaceError, OperationalError, connection
from django.db.models import Field, Model

from queues import dkim, lib
from queues.config import once_per_process, store_settings
from queues.database import (
    drop_connection,
    insert_many_with_children,
    insert_with_children,
    is_outage,
)
from queues.lib import clock, header_end, inspect_headers
from queues.models import (
    Event,
    EventLevel,
    Message,
    MessageSource,
    MessageState,
    Recipient,
    RecipientState,
)

log = logging.getLogger(__name__)

_B32 = "0123456789BCDFGHJKLMNPQRSTVWXYZ"  # no vowels: ids never spell words


@dataclass
class IncomingRecipient:
    address: str
    orcpt: str = ""
    notify: str = ""


@dataclass
class IncomingEnvelope:
    mail_from: str
    recipients: list[IncomingRecipient]
    body_type: str = ""
    smtputf8: bool = False
    ret: str = ""
    envid: str = ""
    declared_size: int | None = None
    client_address: str | None = None
    client_helo: str = ""
    client_name: str = ""
    protocol: str = "ESMTP"  # RFC 3848 with-keyword: SMTP, ESMTP, ESMTPS, UTF8SMTPS...
    source: str = MessageSource.SMTP
    auth_account: str = ""  # the SmtpAccount username of an authenticated client (SMTP AUTH)
    # DKIM-sign it (queues.dkim): only mail we vouch for. The SMTP ingress sets it
    # for relay networks and AUTH, pickup and DSNs always; never for the rest.
    dkim_sign: bool = False


def new_qid() -> str:
    """A 14-character queue id: 45 bits of milliseconds, then 25 random bits."""
    value = ((int(time.time() * 1000) & (2**45 - 1)) << 25) | secrets.randbits(25)
    chars = []
    for _ in range(14):
        value, digit = divmod(value, len(_B32))
        chars.append(_B32[digit])
    return "".join(reversed(chars))


def printable(text: str) -> str:
    """Client-supplied text made safe for a text column and a header: undecodable
    bytes (surrogate escapes), NUL and other control characters replaced."""
    clean = text.encode("utf-8", "replace").decode("utf-8")
    return "".join(c if c.isprintable() else "?" for c in clean)


def recipient_domain(address: str) -> str:
    """``Recipient.domain``: the address's domain in the form it is routed by.

    The parsers normalise every address at accept (``delivery.smtpd.policy``),
    so this is its domain part as stored (A-labels; an address literal in
    lower case). Addresses from elsewhere (a DSN to a sender stored before
    normalisation) are normalised here; one without a form is kept in lower
    case, and routing refuses it (5.1.3).
    """
    domain = address.rpartition("@")[2]
    try:
        return lib.domain_key(domain)
    except lib.DomainError:
        return domain.rstrip(".").lower()


def _received_header(env: IncomingEnvelope, qid: str, when: str) -> bytes:
    helo = printable(env.client_helo) or "unknown"
    peer = f"{env.client_name or 'unknown'} [{env.client_address or 'unknown'}]"
    line = (
        f"Received: from {helo} ({peer})\r\n"
        f"\tby {store_settings().hostname} (mailrelay) with {env.protocol} id {qid}"
    )
    if len(env.recipients) == 1:
        line += f"\r\n\tfor <{env.recipients[0].address}>"
    return (line + f"; {when}\r\n").encode("utf-8", "surrogateescape")


_last_date: tuple[datetime, str] | None = None  # (a second, format_datetime of it)


def _date_field(now: datetime) -> str:
    """``format_datetime(now)``, made once per second: it has no fraction of a
    second, and every message of that second (on any database thread) shares it."""
    global _last_date
    second = now.replace(microsecond=0)
    last = _last_date  # one read: another thread may replace it meanwhile
    if (
        last is not None
        and last[0] == second
        and last[0].tzinfo is second.tzinfo
        and last[0].fold == second.fold
    ):
        return last[1]
    text = format_datetime(now)
    _last_date = (second, text)
    return text


def build_prefix(
    env: IncomingEnvelope, data: bytes | bytearray, qid: str
) -> tuple[bytes, str, str]:
    """Our Received header (and a Message-ID when missing), to store before ``data``.

    Returns the prefix, the Message-ID and the Subject.
    """
    info = inspect_headers(data)
    when = _date_field(clock.now())
    prefix = _received_header(env, qid, when)
    message_id = info.message_id
    if not message_id:
        message_id = f"<{qid}.{int(time.time())}@{store_settings().hostname}>"
        prefix += f"Message-ID: {message_id}\r\n".encode("ascii", "replace")
    return prefix, message_id, info.subject


def build_stored_bytes(env: IncomingEnvelope, data: bytes, qid: str) -> tuple[bytes, str, str]:
    """The bytes to store (prefix and data joined), the Message-ID and the Subject."""
    prefix, message_id, subject = build_prefix(env, data, qid)
    return prefix + data, message_id, subject


# --- DKIM: whether a message is signed, and with which key (the crypto and the
# keys' material are queues.dkim's) ---


class KeyStore:
    """Keys loaded once and kept; reloaded at most every ``refresh`` seconds
    (a new ``DkimKey`` or key file is used within that time, no restart)."""

    def __init__(self, keys_dir: str, refresh: float, signing_domain: str = "") -> None:
        self.keys_dir = keys_dir
        self.refresh = refresh
        self.signing_domain = signing_domain  # in its one form already (settings.py)
        self._lock = threading.Lock()
        self._keys: dict[str, dkim.SigningKey] = {}
        self._loaded_at: float | None = None

    def keys(self) -> dict[str, dkim.SigningKey]:
        now = time.monotonic()
        if self._loaded_at is not None and now - self._loaded_at < self.refresh:
            return self._keys
        with self._lock:  # one reload for all the ingress's database threads
            if self._loaded_at is None or now - self._loaded_at >= self.refresh:
                self._reload(now)
        return self._keys

    def loaded_keys(self) -> dict[str, dkim.SigningKey] | None:
        """The keys if they need no reload now (``keys`` would not read the
        database or the files), else None."""
        loaded_at = self._loaded_at
        if loaded_at is None or time.monotonic() - loaded_at >= self.refresh:
            return None
        return self._keys

    def _reload(self, now: float) -> None:
        try:
            self._keys = dkim.load_keys_reconnecting(self.keys_dir)
            self._loaded_at = now
        except Error as exc:
            # Keep the keys we had (the files' at first); the database again next message.
            log.warning("DKIM keys not reloaded from the database: %s", exc)
            if self._loaded_at is None:
                self._keys = dkim.load_keys(self.keys_dir, use_database=False)
            self._loaded_at = now - self.refresh

    def key_for(self, domain: str) -> dkim.SigningKey | None:
        """The key of the From domain or its closest parent, else the signing domain's."""
        keys = self.keys()
        if not keys:
            return None
        name = domain
        while "." in name:
            if (key := keys.get(name)) is not None:
                return key
            name = name.partition(".")[2]
        return keys.get(self.signing_domain)  # "" names no key


@once_per_process
def key_store() -> KeyStore:
    """The process's KeyStore, built at first use (again after a setting changes)."""
    config = store_settings()
    return KeyStore(config.dkim_keys_dir, config.dkim_key_refresh, config.dkim_signing_domain)


def reset_key_store() -> None:
    """Forget the loaded keys (a key added or removed by an operator in this process)."""
    key_store.cache_clear()


def sign_message(prefix: bytes, data: bytes | bytearray) -> tuple[bytes, dkim.SigningKey | None]:
    """(signature header, key) for the message ``prefix + data`` as it will be
    stored; (b"", None) when no key applies. Raises DkimError (or anything
    dkimpy raises) when signing fails: the caller stores the message unsigned."""
    store = key_store()
    if not store.keys():
        return b"", None  # no DKIM configured: not even the From field is read
    domain = dkim.from_domain(data, header_end(data))
    if domain is None:
        return b"", None  # RFC 6376 5.4: From must be signed; without one, nothing to sign
    key = store.key_for(domain)
    if key is None:
        return b"", None
    return dkim.sign(data, key, prefix=bytes(prefix)), key


def _dkim_signature(qid: str, prefix: bytes, data: bytes | bytearray) -> tuple[bytes, str]:
    """The DKIM-Signature to store with the message (b"" when no key applies),
    and why signing failed ("" when it did not). A failure never refuses the
    message: it is stored unsigned and an event says so (``_dkim_failed``)."""
    try:
        signature, _key = sign_message(prefix, data)
    except Exception as exc:  # noqa: BLE001 - any failure: stored unsigned, never lost
        log.warning("%s: DKIM signing failed, stored unsigned: %s", qid, exc)
        return b"", f"{type(exc).__name__}: {exc}"
    return signature, ""


def _dkim_failed(prepared: PreparedMessage) -> None:
    error = prepared.dkim_error
    try:
        Event.objects.create(
            created_at=clock.now(),
            level=EventLevel.WARNING,
            kind="dkim_sign_failed",
            text=f"message {prepared.qid} is sent unsigned: DKIM signing failed ({error})",
            message_id=prepared.row.pk,
            data={"error": error[:1000]},
        )
    except Exception:  # noqa: BLE001 - the message is stored; the log carries it
        log.warning("%s: could not record the DKIM failure event", prepared.qid, exc_info=True)


def prepares_alone(env: IncomingEnvelope) -> bool:
    """Whether ``prepare_message(env, …)`` needs neither the database nor a DKIM
    signature: no signing asked, or the DKIM keys loaded and there are none. It
    is then a few dozen microseconds of Python, which the SMTP ingress runs on
    its event loop instead of handing it to a database thread and back."""
    return not env.dkim_sign or key_store().loaded_keys() == {}


@functools.cache
def _row_plan(model: type[Model]) -> tuple[dict[str, int], list[object], tuple[Field, ...]]:
    """``NewRow``'s plan for ``model``: each concrete field's position, the default
    of each field whose default is a constant, the fields whose default is made
    per row (a callable, a database default's expression)."""
    fields = model._meta.concrete_fields
    called = tuple(
        f for f in fields if (f.has_default() and callable(f.default)) or f.has_db_default()
    )
    template = [None if f in called else f.get_default() for f in fields]
    return {f.attname: i for i, f in enumerate(fields)}, template, called


class NewRow:
    """A row of ``model`` to insert: its concrete fields' values in their order
    (``values``, the defaults filled in; what ``queues.database``'s insert
    sends), read by attname as an instance is (``row.qid``), its primary key
    set once inserted (``pk``).

    The ingress inserts these, not model instances: ``Model.__init__`` (a
    ``setattr`` per field, its signals) and reading each field back for the
    statement cost more than the rest of preparing a message. ``instance()``
    builds the model instance when one is asked for (``message_accept``)."""

    __slots__ = ("model", "pk", "values")

    def __init__(self, model: type[Model], **values: object) -> None:
        index, template, called = _row_plan(model)
        row = template.copy()
        for field in called:
            if field.attname not in values:
                row[index[field.attname]] = field.get_default()
        for name, value in values.items():
            row[index[name]] = value  # a KeyError names a field the model has not
        self.model, self.values, self.pk = model, row, None

    def __getattr__(self, name: str) -> object:
        try:
            return self.values[_row_plan(self.model)[0][name]]
        except KeyError:
            raise AttributeError(name) from None

    def instance(self, deferred: Sequence[str] = ()) -> Model:
        """The model instance of this row: saved when ``pk`` is set, the fields
        ``deferred`` left to be read from the database if asked for."""
        obj = self.model(*self.values)
        if self.pk is not None:
            obj.pk = self.pk
            obj._state.adding = False
        for name in deferred:
            obj.__dict__.pop(name, None)
        return obj


@dataclass
class PreparedMessage:
    """A message ready to insert: its row, its recipients' rows, its data pieces."""

    row: NewRow
    recipients: list[NewRow]
    parts: dict[str, tuple[bytes, bytes | bytearray]]
    dkim_error: str
    env: IncomingEnvelope  # what it was made from: prepared again under a new queue id
    data: bytes | bytearray

    @property
    def qid(self) -> str:
        return self.row.qid  # type: ignore[return-value]

    @property
    def message(self) -> Message:
        """The message as a ``Message``, made on each use (the ingress needs none):
        saved once the row's pk is set, its data read back if asked for."""
        return self.row.instance(deferred=tuple(self.parts))  # type: ignore[return-value]


def prepare_message(
    env: IncomingEnvelope, data: bytes | bytearray, *, sign: bool = True
) -> PreparedMessage:
    """Everything ``message_accept`` does before the database: ids, headers, DKIM.

    ``sign=False``: the caller found ``prepares_alone`` true and prepares on its
    event loop; the keys are not looked at again (they may fall due for a reload
    from the database just then, which the loop must not do), so the message is
    prepared as that check saw them: nothing to sign."""
    now = clock.now()
    qid = new_qid()
    prefix, message_id, subject = build_prefix(env, data, qid)
    # Signed once, here, where the body is in memory already (queues.dkim).
    signed = env.dkim_sign and sign
    signature, dkim_error = _dkim_signature(qid, prefix, data) if signed else (b"", "")
    row = NewRow(
        Message,
        qid=qid,
        state=MessageState.SUBMISSION,
        source=env.source,
        mail_from=env.mail_from,
        body_type=env.body_type,
        smtputf8=env.smtputf8,
        ret=env.ret,
        envid=env.envid,
        declared_size=env.declared_size,
        client_address=env.client_address,
        client_helo=printable(env.client_helo)[:255],
        data=b"",  # stored from ``parts`` below
        size=len(prefix) + len(data),
        message_id=message_id,
        subject=subject,
        received_at=now,
        expires_at=now + store_settings().message_expiration,
        next_attempt_at=now,
        signature=signature,
        auth_account=env.auth_account,
    )
    recipients = [
        NewRow(
            Recipient,
            address=rcpt.address,
            domain=recipient_domain(rcpt.address),
            orcpt=rcpt.orcpt,
            notify=rcpt.notify,
            state=RecipientState.SUBMITTED,
            next_attempt_at=now,
        )
        for rcpt in env.recipients
    ]
    return PreparedMessage(row, recipients, {"data": (prefix, data)}, dkim_error, env, data)


# A queue id is 45 bits of time and 25 random bits: two messages of the same
# millisecond (on any ingress) may draw the same one. The unique index tells;
# the message is then prepared again under a new id (its Received header and a
# generated Message-ID name it), so a collision costs a retry, never a message.
QID_DRAWS = 5


class QueueIdTaken(Exception):
    """The queue id drawn for a message is held by another stored message."""


# A message stored: as found in the store, or as it was prepared (its row's pk set).
Accepted = Message | PreparedMessage


def _as_message(accepted: Accepted) -> Message:
    return accepted.message if isinstance(accepted, PreparedMessage) else accepted


def _insert_one(prepared: PreparedMessage) -> Accepted:
    """One message in its own statement (and transaction), retried once on a lost
    connection, and under a new queue id when its own is another message's."""
    for _ in range(QID_DRAWS):
        try:
            return _insert_as_drawn(prepared)
        except QueueIdTaken as taken:
            log.warning("queue id %s is another message's; drawing a new one", taken)
            prepared = prepare_message(prepared.env, prepared.data)
    raise IntegrityError(f"no free queue id in {QID_DRAWS} draws")


def _insert_as_drawn(prepared: PreparedMessage) -> Accepted:
    try:
        return _insert_once(prepared)
    except (OperationalError, InterfaceError) as exc:
        if not is_outage(exc) or connection.in_atomic_block or connection.vendor != "postgresql":
            raise  # the caller's transaction is lost with the connection; SQLite is local
        qid = prepared.qid
        # Debug only: while the database is away every message comes here, and
        # the 451 (if the retry fails too) is logged once by the SMTP session.
        log.debug("%s: database connection lost; retrying once on a new one", qid)
        connection.close()
    stored = _qid_holder(prepared.row)
    if stored is not None:
        return stored  # committed before the connection died
    return _insert_once(prepared)


def _insert_once(prepared: PreparedMessage) -> Accepted:
    row = prepared.row
    try:
        insert_with_children(row, prepared.recipients, "message", parts=prepared.parts)
    except IntegrityError:
        # Its queue id is taken: by this very message (a group commit that
        # failed after committing stored it, and looking it up then failed
        # too), or by another one (QueueIdTaken: a new id).
        stored = None if connection.in_atomic_block else _qid_holder(row)
        if stored is None:
            raise
        log.warning("%s: already stored by a failed group commit", prepared.qid)
        return stored
    if prepared.dkim_error:
        _dkim_failed(prepared)
    return prepared


def _qid_holder(message: Message | NewRow) -> Message | None:
    """The stored row with ``message``'s queue id when it is this very message;
    None when no row has it; QueueIdTaken when another message's row does."""
    stored = Message.objects.filter(qid=message.qid).defer("data").first()
    if stored is not None and not _same_message(stored, message):
        raise QueueIdTaken(message.qid)
    return stored


def _same_message(stored: Message, message: Message | NewRow) -> bool:
    """Whether the row ``stored`` is ``message`` (same queue id, envelope, size
    and arrival instant), not another message that drew the same queue id."""
    fields = ("size", "mail_from", "received_at", "message_id", "client_address")
    return all(getattr(stored, f) == getattr(message, f) for f in fields)


def message_accept(env: IncomingEnvelope, data: bytes | bytearray) -> Message:
    """Store a message and one row per recipient in one transaction.

    The caller replies 250 only after this returns: the commit has happened.
    ``data`` is not copied: the database joins our prefix and it (see
    insert_with_children), so a large message costs its size about twice.
    The returned message's ``data`` is read back from the database if used.

    A connection that died since its last use (a PostgreSQL restart, a
    terminated backend) fails the first statement; the store is then retried
    once on a new connection, so the client is not refused for a stale
    connection. The retry first looks for the queue id: if the lost reply
    was for a commit that happened, the message is not stored twice.
    """
    return _as_message(prepared_accept(prepare_message(env, data)))


def prepared_accept(prepared: PreparedMessage) -> Accepted:
    """``message_accept`` of a message prepared (and signed) already: the SMTP
    ingress prepares in the session's database thread, so a slow signature
    never holds up the committer threads other sessions wait on."""
    return _insert_one(prepared)


def messages_accept(
    batch: Sequence[tuple[IncomingEnvelope, bytes | bytearray]],
) -> list[Message | Exception]:
    """Group commit: store several messages in ONE statement (one transaction, one commit).

    Returns, in order, each message or the exception that kept it out
    (``prepared_accept_many``). A message that cannot be prepared fails alone.
    """
    results: list[Message | Exception] = []
    ready: list[tuple[int, PreparedMessage]] = []
    for env, data in batch:
        try:
            ready.append((len(results), prepare_message(env, data)))
            results.append(None)  # type: ignore[arg-type] - filled in below
        except Exception as exc:  # noqa: BLE001 - this message fails, the others go on
            log.exception("could not prepare a message from %s", env.client_address)
            results.append(exc)
    stored = prepared_accept_many([prepared for _index, prepared in ready])
    for (index, _prepared), result in zip(ready, stored, strict=True):
        results[index] = result if isinstance(result, Exception) else _as_message(result)
    return results


def prepared_accept_many(ready: Sequence[PreparedMessage]) -> list[Accepted | Exception]:
    """Group commit of prepared messages: ONE statement (one transaction, one commit).

    Returns, in order, each message or the exception that kept it out: the
    caller replies 250 to a message only when its entry is a Message (it is
    committed). A failed batch commits nothing, so nobody is told 250 for it;
    its messages are then stored one by one (``message_accept``'s path), so a
    bad message fails alone and the innocent ones are stored. A connection
    lost around the batch's commit leaves it unknown whether the commit
    happened: the queue ids are looked up on a new connection first, so no
    message is stored twice; a row found counts only when it is that very
    message (``_same_message``), and a queue id another message holds is a
    collision: the message is stored under a new one (``_insert_one``).
    """
    if len(ready) == 1 or (ready and connection.vendor != "postgresql"):
        return [_try_one(prepared) for prepared in ready]
    if not ready:
        return []
    try:
        insert_many_with_children(
            [(p.row, p.recipients, p.parts) for p in ready], "message", key_field="qid"
        )
    except Exception as exc:  # noqa: BLE001 - nothing of the batch is committed (or unknown)
        log.log(
            logging.DEBUG if _unavailable(exc) else logging.WARNING,
            "a group commit of %d messages failed (%s); storing them one by one",
            len(ready),
            exc,
        )
        # Whatever failed, the statement may have committed before it (a lost
        # connection, or an error after the INSERT returned): look the queue ids
        # up first, so no committed message gets 451 and is stored twice.
        if is_outage(exc):
            drop_connection()
        stored = _already_stored([p.row for p in ready])
        results: list[Accepted | Exception] = []
        for prepared in ready:
            found = stored.get(prepared.qid)
            results.append(found if found is not None else _try_one(prepared))
        return results
    for prepared in ready:
        if prepared.dkim_error:
            _dkim_failed(prepared)
    return list(ready)


def _try_one(prepared: PreparedMessage) -> Accepted | Exception:
    try:
        return _insert_one(prepared)
    except Exception as exc:  # noqa: BLE001 - handed to this message's session (451)
        # The session answers 451 and logs it; a database that is away is not news here.
        level = logging.DEBUG if _unavailable(exc) else logging.WARNING
        log.log(level, "%s: could not be stored: %s", prepared.qid, exc)
        drop_connection()  # a broken connection is not reused by the next message
        return exc


def _already_stored(messages: list[NewRow]) -> dict[str, Message]:
    """Messages of a batch whose commit may have happened before its connection
    was lost: each found by its queue id, and only when the row is that very
    message (another message holding the id is a collision: _insert_one)."""
    by_qid = {m.qid: m for m in messages}
    try:
        rows = Message.objects.filter(qid__in=list(by_qid)).defer("data")
        return {m.qid: m for m in rows if _same_message(m, by_qid[m.qid])}
    except Exception as exc:  # noqa: BLE001 - then each is retried, which finds its own qid
        if _unavailable(exc):
            log.debug("could not look up the messages of a lost batch: %s", exc)
        else:
            log.warning("could not look up the messages of a lost batch", exc_info=True)
        drop_connection()
        return {}


def _unavailable(exc: BaseException) -> bool:
    """The database is away (refused, lost, a read-only standby): not a bug to trace."""
    return isinstance(exc, (OperationalError, InterfaceError))
