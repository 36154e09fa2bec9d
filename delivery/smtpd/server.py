"""The inbound SMTP server: aiosmtpd with our policy, and 250 only after the commit.

One ``InboundServer`` per process owns the listeners, a small pool of database
threads (``DatabaseExecutor``: ``message_accept`` is synchronous Django ORM) and the
categorizer doorbell (``CoalescedBell``), each in its section below. Each connection
is a ``session.InboundSMTP`` (the protocol, behind the aiosmtpd adapter), which asks
``policy`` what to accept; the DATA work lives in ``RelayHandler`` here. Settings are
read once, into ``config.InboundConfig``.

Hot path per message: the data checked (``session``'s checks: bare line
endings, the header's limits, hops, an account's header sender), the message
prepared (ids, headers, DKIM signature: ``prepare_message``; in a database
thread when it signs), then handed to the group committer (``GroupCommitter``, below:
the messages of every session waiting at that moment in one statement and one
transaction, in a committer thread), the reply once its transaction
committed, then a coalesced ring of the categorizer. The other database calls
(AUTH, account rates) run in the database threads too.

Back pressure: with a ``Monitor`` (delivery.backpressure), the server runs it
while it listens, counts the messages it holds uncommitted (the version
buckets), and asks it at every MAIL FROM whether to tarpit (an
``asyncio.sleep`` in that session only) or refuse with ``452 4.3.1``.
Connections, EHLO, RSET, NOOP and QUIT are never held back.

Limits (Postfix's anvil and smtpd_* limits): connections in total and per
client (``InboundServer.admit``; 421 and close, the listener goes on), a
session's lifetime, a budget of commands that move no message, and a DATA
deadline that grows with the bytes received (``DataDeadline``). A message's
data is held once, in a bytearray, while it is read and stored.

Submission (issue #11): besides the relay listeners (``smtp``), a server may
listen for ``submission`` (587: STARTTLS required before AUTH and MAIL, and
AUTH before MAIL) and ``submissions`` (465: implicit TLS, RFC 8314). AUTH
PLAIN and LOGIN are offered inside TLS on every listener; the password check
(``queues.services.accounts``) runs in the database threads. An
authenticated client relays to any domain from the senders its account
allows, and back pressure treats it as trusted. Certificates are re-read when
their files change (``TlsCertificate``), checked on each new connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiosmtpd.smtp import Envelope, Session
from django.core.exceptions import ImproperlyConfigured
from django.db import InterfaceError, OperationalError, connection, connections

from delivery.backpressure.samplers import InFlight
from delivery.smtpd import policy
from delivery.smtpd.auth import header_sender_refusal
from delivery.smtpd.authlimit import AuthLimiter
from delivery.smtpd.config import SMTP_LISTENER, SUBMISSION, SUBMISSIONS, InboundConfig
from delivery.smtpd.session import (
    MAX_RECEIVED_HEADERS,
    InboundSMTP,
    RelayEnvelope,
    has_bare_line_ending,
    header_limit_refusal,
    protocol_keyword,
    received_count,
)
from queues import counters
from queues.accept import (
    IncomingEnvelope,
    PreparedMessage,
    prepare_message,
    prepared_accept,
    prepared_accept_many,
    prepares_alone,
)
from queues.database import OUTAGE, drop_connection, first_line, is_unavailable
from queues.models import MessageSource
from queues.signals import categorizer_work

if TYPE_CHECKING:
    from delivery.backpressure.monitor import Monitor

log = logging.getLogger(__name__)

DEFAULT_DB_THREADS = 8
# A committer thread reconnects after storing this much (_store, GroupCommitter._commit).
RELEASE_CONNECTION_ABOVE = 8 * 1024 * 1024


# ----------------------------------------------------------------- committing


def _store(prepared: PreparedMessage, data: bytes | bytearray) -> str:
    """Runs in a committer thread: commit the prepared message, return its queue id."""
    try:
        qid = prepared_accept(prepared).qid
        if len(data) >= RELEASE_CONNECTION_ABOVE:
            # libpq's send buffer grew to the message's size and is only freed
            # with the connection: without this, each database thread would keep
            # the size of the largest message it ever stored.
            connection.close()
        return qid
    except BaseException:
        # After a failed COMMIT or a lost server the connection is broken or in
        # an unknown state: drop it so the next message on this thread reconnects.
        drop_connection()
        raise


def _store_batch(batch: Sequence[tuple[PreparedMessage, bytes | bytearray]]) -> list[object]:
    """Runs in a committer thread: the queue id of each message committed, or its
    exception. The messages come prepared (``InboundServer.store``). One message takes
    ``_store`` (``message_accept``'s path); several are one group commit
    (``prepared_accept_many``: a failed batch's messages then one by one)."""
    if len(batch) == 1:
        try:
            return [_store(*batch[0])]
        except Exception as exc:  # noqa: BLE001 - this message's session says 451
            return [exc]
    stored = prepared_accept_many([prepared for prepared, _data in batch])
    return [result if isinstance(result, Exception) else result.qid for result in stored]


def _in_thread(call: Callable[[], object]) -> object:
    """Runs in a database thread: one call; a failed connection is dropped (as in _store)."""
    try:
        return call()
    except BaseException:
        drop_connection()
        raise


# ----------------------------------------------------------------- the DATA handler


class RelayHandler:
    """The aiosmtpd handler: what happens to a message once its data is in."""

    def __init__(self, store: Callable[[IncomingEnvelope, bytes], Awaitable[str]]) -> None:
        self.store = store  # InboundServer.store

    async def handle_DATA(self, smtp: InboundSMTP, session: Session, envelope: Envelope) -> str:  # noqa: N802
        assert isinstance(envelope, RelayEnvelope)
        data = envelope.original_content or b""
        try:
            if has_bare_line_ending(data):
                log.warning("rejected message with bare CR/LF from %s", smtp.client_ip)
                return policy.BARE_LINE_ENDING
            if refusal := header_limit_refusal(
                data, smtp.config.max_header_fields, smtp.config.max_header_size
            ):
                log.info("%s: %s", smtp.client_ip, refusal)
                return refusal
            if received_count(data) > MAX_RECEIVED_HEADERS:
                return policy.TOO_MANY_HOPS
            if smtp.grant is not None and (refusal := header_sender_refusal(smtp.grant, data)):
                log.info("%s: %s", smtp.client_ip, refusal)
                return refusal
            params = envelope.params
            incoming = IncomingEnvelope(
                mail_from=envelope.mail_from or "",
                recipients=envelope.recipients,
                body_type=params.body,
                smtputf8=params.smtputf8,
                ret=params.ret,
                envid=params.envid,
                declared_size=params.size,
                client_address=str(smtp.client_ip) if smtp.client_ip else None,
                client_helo=session.host_name or "",
                client_name="",  # no reverse DNS on the hot path
                protocol=protocol_keyword(
                    extended=session.extended_smtp,
                    tls=smtp.tls_active,
                    utf8=params.smtputf8,
                    auth=smtp.grant is not None,
                ),
                source=MessageSource.SMTP,
                auth_account=smtp.grant.username if smtp.grant is not None else "",
                # DKIM vouches only for our own clients' mail (README "DKIM"), never
                # for what the internet hands in for an accepted domain.
                dkim_sign=smtp.may_relay,
            )
        except Exception:
            log.exception("could not prepare a message from %s", smtp.client_ip)
            return policy.INTERNAL_ERROR
        try:
            started = time.perf_counter()
            qid = await self.store(incoming, data)
        except Exception as exc:
            if not is_unavailable(exc):
                log.exception("could not store a message from %s", smtp.client_ip)
                return policy.STORE_FAILED
            # The database is away: one line per 451, the outage once as it starts and ends.
            OUTAGE.failed(exc)
            log.warning("451 4.3.0 message from %s not stored: %s", smtp.client_ip, first_line(exc))
            return policy.STORE_FAILED
        counters.SMTP_ACCEPT_SECONDS.observe(time.perf_counter() - started)
        counters.MESSAGES_ACCEPTED.labels(source="smtp").inc()
        OUTAGE.recovered()
        log.info(
            "%s: from=<%s> nrcpt=%d size=%d client=%s",
            qid,
            incoming.mail_from,
            len(incoming.recipients),
            len(data),
            smtp.client_ip,
        )
        return policy.QUEUED.format(qid=qid)

    async def handle_exception(self, error: Exception) -> str:
        log.error("inbound SMTP session error", exc_info=error)
        return policy.INTERNAL_ERROR


# ----------------------------------------------------------------- the server


class InboundServer:
    """Listeners, database threads and the doorbell of one ingress process."""

    def __init__(
        self,
        config: InboundConfig,
        *,
        db_threads: int = DEFAULT_DB_THREADS,
        monitor: Monitor | None = None,
        commit_threads: int | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.config = config
        self.reuse_port = reuse_port  # several runsmtp processes share the ports
        self.db_threads = db_threads
        # Committer threads (group commit); no more than the database threads asked for.
        self.commit_threads = commit_threads or min(db_threads, DEFAULT_COMMIT_THREADS)
        self.monitor = monitor
        # Messages received and not yet committed: the monitor's version buckets.
        self.uncommitted = monitor.uncommitted if monitor is not None else InFlight()
        self.sessions: set[InboundSMTP] = set()
        self.per_client: Counter[str] = Counter()  # open sessions per client_key
        self.addresses: list[tuple[str, int]] = []
        self.bound: dict[str, list[tuple[str, int]]] = {}  # listener kind → its addresses
        self.auth_limiter = AuthLimiter(
            config.max_auth_failures,
            config.max_auth_failures_per_user,
            processes=config.processes,
        )
        self._listeners: list[asyncio.Server] = []
        self._stores: set[asyncio.Future] = set()
        self._stopping = False
        self._no_sessions = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._executor: DatabaseExecutor | None = None
        self._committer: GroupCommitter | None = None
        self._bell: CoalescedBell | None = None

    async def start(
        self,
        addresses: Sequence[tuple[str, int]],
        *,
        submission: Sequence[tuple[str, int]] = (),
        submissions: Sequence[tuple[str, int]] = (),
    ) -> list[tuple[str, int]]:
        """Listen on every (host, port); returns the bound addresses (port 0 → real port).

        ``addresses`` are relay listeners (port 25), ``submission`` STARTTLS-then-AUTH
        listeners (587), ``submissions`` implicit-TLS listeners (465); ``self.bound``
        has each kind's bound addresses.
        """
        if (submission or submissions) and self.config.tls is None:
            raise ImproperlyConfigured(
                "submission listeners need MAILRELAY_TLS_CERT_FILE and MAILRELAY_TLS_KEY_FILE"
            )
        self.loop = asyncio.get_running_loop()
        self._executor = DatabaseExecutor(self.db_threads)
        self._committer = GroupCommitter(self.commit_threads, store_batch=_store_batch)
        self._bell = CoalescedBell(self.loop, self._executor)
        handler = RelayHandler(self.store)
        try:
            if self.monitor is not None:
                await self.monitor.start()  # judged from the first session on
            kinds = (
                (SMTP_LISTENER, addresses),
                (SUBMISSION, submission),
                (SUBMISSIONS, submissions),
            )
            for kind, listen in kinds:
                for host, port in listen:
                    await self._listen(handler, kind, host, port)
        except BaseException:
            await self.stop()
            raise
        return list(self.addresses)

    async def _listen(self, handler: RelayHandler, kind: str, host: str, port: int) -> None:
        assert self.loop is not None
        tls = self.config.tls
        listener = await self.loop.create_server(
            functools.partial(InboundSMTP, self, handler, kind),
            host=host or None,
            port=port,
            reuse_address=True,
            reuse_port=self.reuse_port or None,
            backlog=512,
            ssl=tls.listener_context() if kind == SUBMISSIONS and tls is not None else None,
        )
        self._listeners.append(listener)
        for sock in listener.sockets:
            bound = sock.getsockname()
            self.addresses.append((bound[0], bound[1]))
            self.bound.setdefault(kind, []).append((bound[0], bound[1]))

    async def in_database(self, function: Callable[..., object], *args, **kwargs) -> object:
        """Run a synchronous ORM call in a database thread (never on the event loop)."""
        assert self.loop is not None and self._executor is not None
        call = functools.partial(function, *args, **kwargs)
        return await self._executor.run_on(self.loop, _in_thread, call)

    async def store(self, envelope: IncomingEnvelope, data: bytes) -> str:
        """Prepare and commit a message (``GroupCommitter``), then ring the categorizer.

        Prepared first (queue id, headers, DKIM signature): with a signature to make,
        in a database thread, so signing holds up no other session (the committer
        threads only insert); else on the loop (``prepares_alone``). The commit runs
        to its end even if the client goes away (shielded), the ring follows every
        commit, replied to or not. The queue id comes back once its commit is done."""
        assert self.loop is not None and self._committer is not None
        self.uncommitted.value += 1  # received, not committed: from now on (loop only)
        try:
            if prepares_alone(envelope):  # nothing to sign: no thread and back for it
                prepared = prepare_message(envelope, data, sign=False)
            else:
                prepared = await self.in_database(prepare_message, envelope, data)
            assert isinstance(prepared, PreparedMessage)
            future = self._committer.submit_on(self.loop, prepared, data)
        except BaseException:
            self.uncommitted.value -= 1
            raise
        self._stores.add(future)
        future.add_done_callback(self._stored)
        return await asyncio.shield(future)

    def _stored(self, future: asyncio.Future) -> None:
        self._stores.discard(future)
        self.uncommitted.value -= 1
        if not future.cancelled() and future.exception() is None:
            assert self._bell is not None
            self._bell.request()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def admit(self, session: InboundSMTP) -> str | None:
        """Count a new connection in, or return the 421 that refuses it (Postfix's anvil)."""
        config = self.config
        if config.max_connections and len(self.sessions) >= config.max_connections:
            log.warning("refused %s: %d connections open", session.client_ip, len(self.sessions))
            return policy.TOO_MANY_CONNECTIONS
        key = policy.client_key(session.client_ip)
        if session.kind != SMTP_LISTENER and self.auth_limiter.locked_out(key):
            log.warning("refused %s: too many AUTH failures", session.client_ip)
            return policy.AUTH_LOCKED_OUT
        if not session.trusted:
            limit = config.max_connections_per_client
            if limit and self.per_client[key] >= limit:
                log.warning("refused %s: %d connections from %s", session.client_ip, limit, key)
                return policy.TOO_MANY_FROM_CLIENT
            self.per_client[key] += 1
            session.counted_as = key
        self.sessions.add(session)
        return None

    def session_ended(self, session: InboundSMTP) -> None:
        self.sessions.discard(session)
        if session.counted_as is not None:
            key, session.counted_as = session.counted_as, None
            self.per_client[key] -= 1
            if self.per_client[key] <= 0:
                del self.per_client[key]
        if self._stopping and not self.sessions:
            self._no_sessions.set()

    async def stop(self, grace: float = 30.0) -> None:
        """Stop listening, let commits in progress answer, close every session, clean up."""
        if self._stopping:
            return
        self._stopping = True
        for listener in self._listeners:
            listener.close()
        for session in list(self.sessions):
            session.shutdown()
        if self.sessions:
            try:
                await asyncio.wait_for(self._no_sessions.wait(), grace)
            except TimeoutError:
                for session in list(self.sessions):
                    if session.transport is not None:
                        session.transport.abort()
        if self._stores:
            await asyncio.wait(set(self._stores))
        if self._committer is not None:
            assert self.loop is not None
            await self.loop.run_in_executor(None, self._committer.shutdown)
        if self._bell is not None:
            await self._bell.flush()
        if self._executor is not None:
            assert self.loop is not None
            await self.loop.run_in_executor(None, self._executor.shutdown)
        for listener in self._listeners:
            await listener.wait_closed()
        if self.monitor is not None:
            await self.monitor.stop()


# ----------------------------------------------------------------------------
# Group commit on ingress: the messages of several sessions in one transaction.
#
# A statement and a commit cost the database about the same for one message as
# for ten; under load, sessions wait for their commits at the same time. The
# ``GroupCommitter``'s threads (each owning one Django connection) take the first
# waiting message and every other one waiting at that moment (up to ``max_batch``
# messages, ``max_bytes``), store them with one statement
# (``queues.accept.messages_accept``), then answer each message's future: its
# Message once committed, or the exception that kept it out. Nothing waits for a
# batch to fill: with no load a batch is one message, under load batches grow by
# themselves (PostgreSQL's ``commit_delay`` idea, without the delay). One batch of
# small messages is in the database at a time (``_turn``): what arrives meanwhile
# is the next batch, not a batch of one beside it; the other thread starts beside
# a batch of ``OVERLAP_ABOVE`` bytes or more only (a large message's insert must
# not hold up the small ones). A failed batch commits nothing; ``messages_accept``
# then stores its messages one by one, so one bad message gets its 451 alone.
# Each session replies 250 only after its own future holds a Message.
# ----------------------------------------------------------------------------


DEFAULT_COMMIT_THREADS = 2
DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_BYTES = 4 * 1024 * 1024  # a batch holds at most this much message data
OVERLAP_ABOVE = 1024 * 1024  # a batch this large lets the next one start beside it


class LoopReply:
    """A job's answer, handed from its thread straight to an asyncio future on
    ``loop`` (what ``asyncio.wrap_future`` does, without a concurrent Future
    and its lock between: two per message on the ingress)."""

    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()

    def set_running_or_notify_cancel(self) -> bool:
        return not self.future.cancelled()  # read across threads: at worst, work done for nobody

    def set_result(self, result: object) -> None:
        self._settle(self.future.set_result, result)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(self.future.set_exception, exc)

    def _settle(self, settle: Callable[[Any], None], value: object) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_settle_on_loop, self.future, settle, value)


def _settle_on_loop(future: asyncio.Future, settle: Callable[[Any], None], value: object) -> None:
    if not future.cancelled():
        settle(value)


Job = tuple[concurrent.futures.Future | LoopReply, Any, Any]  # (reply, envelope, data)


def _answer(batch: Sequence[Job], results: Sequence[object]) -> bool:
    """Hand each job of a stored batch its result; True if one failed. Replies on a loop
    go in one callback per loop, in order: one wake-up of it per batch, not per message."""
    on_loops: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, object]]] = {}
    for (reply, _e, _d), result in zip(batch, results, strict=True):
        if isinstance(reply, LoopReply):
            on_loops.setdefault(reply.loop, []).append((reply.future, result))
        else:
            (reply.set_exception if isinstance(result, BaseException) else reply.set_result)(result)
    for loop, answers in on_loops.items():
        if not loop.is_closed():
            loop.call_soon_threadsafe(_answer_on_loop, answers)
    return any(isinstance(result, BaseException) for result in results)


def _answer_on_loop(answers: list[tuple[asyncio.Future, object]]) -> None:
    for future, result in answers:
        failed = isinstance(result, BaseException)
        _settle_on_loop(future, future.set_exception if failed else future.set_result, result)


# PostgreSQL takes at most 65535 parameters in one statement; a batch's INSERT
# (queues.database.insert_many_with_children) sends one per column of each message
# and of each recipient. Kept under that with room: a batch of four messages of
# 1000 recipients each is two statements, not a failed one and four retries.
MAX_STATEMENT_PARAMS = 60_000
PARAMS_PER_MESSAGE = 40  # message columns (31 today) with room
PARAMS_PER_RECIPIENT = 24  # recipient columns (19 today) with room


def _params(job: Job) -> int:
    recipients = getattr(job[1], "recipients", ())
    return PARAMS_PER_MESSAGE + PARAMS_PER_RECIPIENT * len(recipients)


StoreBatch = Callable[[Sequence[tuple[Any, Any]]], list[Any]]


def _default_store_batch(batch: Sequence[tuple[Any, Any]]) -> list[Any]:
    from queues.accept import messages_accept

    return messages_accept(batch)


class GroupCommitter:
    """Committer threads that store waiting messages in batches."""

    def __init__(
        self,
        threads: int = DEFAULT_COMMIT_THREADS,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_bytes: int = DEFAULT_MAX_BYTES,
        store_batch: StoreBatch = _default_store_batch,
        name: str = "smtp-commit",
    ) -> None:
        self.max_batch = max(1, max_batch)
        self.max_bytes = max_bytes
        self._store_batch = store_batch
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closed = False
        self.batches = 0  # batches stored (for tests and the log)
        self.messages = 0
        self._count_lock = threading.Lock()
        self._turn = threading.Condition()  # _taken: a thread takes or commits small messages
        self._taken = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, envelope: Any, data: bytes | bytearray) -> concurrent.futures.Future:
        """Queue one message; the future gets its stored Message (committed) or an exception."""
        if self._closed:
            raise RuntimeError("the group committer is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, envelope, data))
        return future

    def submit_on(
        self, loop: asyncio.AbstractEventLoop, envelope: Any, data: Any
    ) -> asyncio.Future:
        """``submit``, answered on ``loop`` (the ingress's sessions)."""
        if self._closed:
            raise RuntimeError("the group committer is shut down")
        reply = LoopReply(loop)
        self._jobs.put((reply, envelope, data))
        return reply.future

    def _take_batch(self, first: Job) -> tuple[list[Job], Job | None, int]:
        """The batch that starts with ``first``, the job taken that did not fit
        in its statement (it starts this thread's next batch), the batch's bytes."""
        batch = [first]
        size = len(first[2])
        params = _params(first)
        while len(batch) < self.max_batch and size < self.max_bytes:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._jobs.put(None)  # shutting down: this thread stops after the batch
                break
            if params + _params(job) > MAX_STATEMENT_PARAMS:
                return batch, job, size
            batch.append(job)
            size += len(job[2])
            params += _params(job)
        return batch, None, size

    def _work(self) -> None:
        try:
            carried: Job | None = None
            while True:
                self._take_turn()
                held = True
                try:
                    if (first := carried or self._jobs.get()) is None:
                        return
                    taken, carried, size = self._take_batch(first)
                    if size >= OVERLAP_ABOVE:  # the next batch may start beside this one
                        self._pass_turn()
                        held = False
                    if batch := [job for job in taken if job[0].set_running_or_notify_cancel()]:
                        self._commit(batch, size)
                finally:
                    if held:
                        self._pass_turn()
                del first, taken, batch  # an idle thread keeps no message body alive
        finally:
            connections.close_all()

    def _take_turn(self) -> None:  # no batch of small messages in the database: take one
        with self._turn:
            self._turn.wait_for(lambda: not self._taken)
            self._taken = True

    def _pass_turn(self) -> None:
        with self._turn:
            self._taken = False
            self._turn.notify()

    def _commit(self, batch: list[Job], size: int) -> None:
        try:
            results = self._store_batch([(envelope, data) for _f, envelope, data in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
        except BaseException as exc:  # noqa: BLE001 - every message of the batch fails (451)
            # A database that is away is logged by each session's 451, not traced here.
            away = isinstance(exc, (OperationalError, InterfaceError))
            level = logging.DEBUG if away else logging.ERROR
            log.log(level, "storing a batch of %d messages failed", len(batch), exc_info=not away)
            self._close_connection()
            for future, _e, _d in batch:
                future.set_exception(exc)
            return
        with self._count_lock:
            self.batches += 1
            self.messages += len(batch)
        failed = _answer(batch, results)
        if failed or size >= RELEASE_CONNECTION_ABOVE:
            self._close_connection()

    @staticmethod
    def _close_connection() -> None:
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail too
            log.debug("closing the committer's database connection failed", exc_info=True)

    def shutdown(self, wait: bool = True) -> None:
        """Stop after every message already queued is stored."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


# ----------------------------------------------------------------------------
# The categorizer doorbell of an ingress process, rung after commits and coalesced.
# ----------------------------------------------------------------------------


RING_INTERVAL = 0.1  # seconds; one categorizer task per ring: batches, not a task per message


def _ring() -> None:
    categorizer_work.send(sender=None)  # the doorbell (delivery.qmgr.tasks)


class CoalescedBell:
    """Rings the categorizer at most once per ``interval``, never blocking a reply.

    A request while a ring is waiting to start is covered by that ring; a request
    while one is in flight gets one more ring after it. So every commit is followed
    by a ring that started after the commit."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        executor: concurrent.futures.Executor,
        interval: float = RING_INTERVAL,
        ring: Callable[[], None] = _ring,
    ) -> None:
        self._loop = loop
        self._executor = executor
        self._interval = interval
        self._ring = ring
        self._timer: asyncio.TimerHandle | None = None
        self._inflight: asyncio.Future | None = None
        self._again = False
        self._last = -math.inf

    def request(self) -> None:
        if self._timer is not None:
            return
        if self._inflight is not None:
            self._again = True
            return
        self._schedule()

    def _schedule(self) -> None:
        delay = max(0.0, self._last + self._interval - self._loop.time())
        self._timer = self._loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._last = self._loop.time()
        self._inflight = self._loop.run_in_executor(self._executor, self._ring)
        self._inflight.add_done_callback(self._rung)

    def _rung(self, future: asyncio.Future) -> None:
        self._inflight = None
        if not future.cancelled() and future.exception() is not None:
            log.warning("ringing the categorizer failed", exc_info=future.exception())
        if self._again:
            self._again = False
            self._schedule()

    async def flush(self) -> None:
        """Ring now what is pending, and wait until no ring is in flight."""
        while self._timer is not None or self._inflight is not None:
            if self._timer is not None:
                self._timer.cancel()
                self._fire()
            assert self._inflight is not None
            await asyncio.wait({self._inflight})


# ----------------------------------------------------------------------------
# Database threads: the inbound server's (and the pickup watcher's) synchronous
# Django ORM calls run in them, each thread owning one connection, not on the loop.
# ----------------------------------------------------------------------------


class DatabaseExecutor(concurrent.futures.Executor):
    """A fixed pool of threads, each owning one Django database connection; unlike
    ThreadPoolExecutor's, each closes it when the pool shuts down (no session left)."""

    def __init__(self, workers: int, name: str = "smtp-db") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the database executor is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def run_on(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any
    ) -> asyncio.Future:
        """``loop.run_in_executor(self, fn, *args)`` answered straight on ``loop``."""
        if self._closed:
            raise RuntimeError("the database executor is shut down")
        reply = LoopReply(loop)
        self._jobs.put((reply, fn, args, {}))
        return reply.future

    def _work(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                future, fn, args, kwargs = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                # Drop the job now: an idle thread would keep its last message's body alive.
                del job, future, fn, args, kwargs
                result = None
        finally:
            connections.close_all()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)  # after every job already queued
        if wait:
            for thread in self._threads:
                thread.join()
