"""The outbound SMTP client: deliver a batch of messages to one destination.

A small asyncio SMTP client of our own rather than aiosmtplib, because it
needs three things aiosmtplib does not give cheaply:

- exact control of every reply: a rejected RCPT, a 421 in the middle of a
  pipelined group or a timeout must become a result for the right
  recipients, not an exception that loses the other replies;
- PIPELINING (RFC 2920): MAIL, every RCPT and DATA go out in one write and
  their replies are read in order, so a message costs two round trips;
- low CPU per message (the relay must pass several hundred messages a
  second on two cores): one ``bytes.replace`` for dot-stuffing, one write
  for the command group, a few large writes for the body.

It must also survive hostile peers: a reply is capped (``MAX_REPLY_LINES``,
``MAX_REPLY_BYTES``, ``READ_LIMIT`` per line) and anything past the cap is a
protocol failure that closes the connection, so a peer can cost a worker a
bounded amount of memory only. Bodies can be read just in time
(``deliver(load_body=...)``) so a round holds at most one per connection,
and a round that lost its recipients (``still_owner()``) starts nothing more:
it is asked before each connection, before each MAIL FROM and before each
final dot (a transaction abandoned after 354 is closed without the dot, so
the next hop has nothing to deliver).

The client never raises for network problems: every exception becomes a
``RecipientResult`` (see ``delivery.smtp.outcome`` for how replies are judged).

This module runs a round's batch (``deliver``, ``_Batch``): messages split
into groups, one connection per group, targets walked in order, failures
remembered per target (``failure.TargetFailure``); each connection secured
(STARTTLS) and, when the next hop has credentials, authenticated
(``auth.authenticate``, RFC 4954). One session is ``connection.Connection``,
its results ``outcome.Recorder``, its TLS contexts ``tlscontext``. What each
target requires is worked out before the round sends, by the round's TLS
plan at the end of this module (``plan``: the TLS policy file, DANE,
MTA-STS and the next hops' AUTH credentials).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from delivery.route.routing import configured_hops, hop_label
from delivery.smtp import outcome
from delivery.smtp.auth import authenticate
from delivery.smtp.clientconfig import ClientConfig
from delivery.smtp.config import round_settings
from delivery.smtp.connection import (
    IMPLICIT_TLS_PORT,
    READ_LIMIT,
    Connection,
    LoadBody,
    SessionCache,
    discard,
)
from delivery.smtp.failure import ClaimLost, NoPeer, SessionFailed, TargetFailure
from delivery.smtp.outcome import Recorder, Security
from delivery.smtp.tls import ENHANCED as TLS_ENHANCED
from delivery.smtp.tls import (
    MAY,
    STRICTNESS,
    TLS_REQUIRED,
    Credentials,
    TlsRequirement,
    dane_requirements,
    lookup_auth,
    mta_sts_requirements,
    parse_auth,
    parse_policy,
)
from delivery.smtp.tlscontext import context_for, sni
from delivery.smtp.types import (
    BatchResult,
    HostFailure,
    OutboundMessage,
    Peer,
    RecipientResult,
)
from queues.lib import clock

log = logging.getLogger(__name__)


# --- helpers --------------------------------------------------------------------


# A round opens another connection only for at least this many messages: a
# connection costs three round trips of its own (greeting, EHLO, QUIT) and a
# pipelined message two, so its set-up stays under a third of what it carries.
MIN_MESSAGES_PER_CONNECTION = 5


def group_size(count: int, config: ClientConfig) -> int:
    """How many of a round's ``count`` messages one connection carries: spread
    over up to ``max_connections`` (a round lasts as long as its longest
    connection, and its messages wait for it), at least
    ``MIN_MESSAGES_PER_CONNECTION`` each, at most ``max_messages_per_connection``."""
    spread = -(-count // max(1, config.max_connections))
    size = max(MIN_MESSAGES_PER_CONNECTION, spread)
    return max(1, min(config.max_messages_per_connection, size))


def connections_for(count: int, config: ClientConfig) -> int:
    """How many connections a round of ``count`` messages opens at once: one per
    group of ``group_size``, up to ``max_connections``."""
    groups = -(-count // group_size(count, config))
    return min(max(1, config.max_connections), groups)


def _split_groups(messages: Sequence[OutboundMessage], size: int) -> list[list[OutboundMessage]]:
    """As few groups as ``size`` allows, balanced (45 at 20 → 15+15+15), so
    the connections finish together instead of one carrying a short tail."""
    size = max(1, size)
    count = -(-len(messages) // size)
    if not count:
        return []
    base, extra = divmod(len(messages), count)
    groups, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        groups.append(list(messages[start:end]))
        start = end
    return groups


def _local_addr(sources: Sequence[str], peer: str) -> tuple[str, int] | None:
    """The source address of the peer's family to bind (port chosen by the system)."""
    if not sources:
        return None
    try:
        version = ipaddress.ip_address(peer.strip("[]")).version
    except ValueError:
        version = 4
    for source in sources:
        if ipaddress.ip_address(source).version == version:
            return (source, 0)
    return None


# --- the batch ------------------------------------------------------------------


@dataclass(slots=True)
class _TargetState:
    # Nothing answered (refused, unreachable, connect or greeting timeout):
    # later connections of this batch skip the target instead of waiting again.
    dead: bool = False
    # The TLS handshake failed: tried again in cleartext after every other
    # target (RFC 7435 opportunistic TLS must not make mail undeliverable).
    tls_broken: bool = False


StillOwner = Callable[[], bool]
# Called with a finished message's results; what it returns (when not None) is
# awaited before the same connection starts its next transaction.
OnSent = Callable[[list[RecipientResult]], Awaitable[object] | None]


class _Batch:
    def __init__(
        self,
        targets: Sequence[Peer],
        config: ClientConfig,
        still_owner: StillOwner | None = None,
        load_body: LoadBody | None = None,
        on_sent: OnSent | None = None,
        cache: SessionCache | None = None,
    ) -> None:
        self.targets = list(targets)
        self.config = config
        self.still_owner = still_owner
        self.load_body = load_body
        self.on_sent = on_sent
        self.cache = cache
        # still_owner() said False once: nothing new starts from then on.
        self.abandoned = False
        self.states = [_TargetState() for _ in self.targets]
        self.results: list[RecipientResult] = []
        self.connected = False
        self.last_failure: TargetFailure | None = None
        self.connection_error = ""
        self.host_failures: list[HostFailure] = []

    def owner(self) -> bool:
        """Whether the round may start something new (a connection, a message).
        Once it may not, it never may again: the recipients have a new owner."""
        if self.abandoned or self.still_owner is None:
            return not self.abandoned
        try:
            owner = self.still_owner()
        except Exception:  # a broken check must not send a second copy: assume lost
            log.exception("still_owner() failed; the round stops as if it lost ownership")
            owner = False
        if not owner:
            log.info("delivery round lost ownership of its recipients; stopping")
            self.abandoned = True
        return not self.abandoned

    def candidates(self) -> Iterator[tuple[int, bool]]:
        """(target index, use STARTTLS) in the order to try them; lazy, so a
        target marked dead by another connection meanwhile is skipped."""
        for i, state in enumerate(self.states):
            if not state.dead and not state.tls_broken:
                yield i, True
        for i, state in enumerate(self.states):
            if state.tls_broken and not state.dead:
                yield i, False

    def _fail(self, failure: TargetFailure) -> TargetFailure:
        self.last_failure = failure
        t = failure.target
        self.host_failures.append(
            HostFailure(
                t.host,
                t.ip,
                t.port,
                failure.phase,
                failure.code,
                failure.text,
                failure.error,
                failure.tls_policy,
            )
        )
        log.info("delivery to %s failed: %s", failure.target.host, failure.describe())
        return failure

    def requirement(self, target: Peer) -> TlsRequirement:
        return self.config.tls_for(target) if self.config.tls_for is not None else MAY

    async def open(self, index: int, use_tls: bool, count: int = 1) -> Connection | TargetFailure:
        """A session kept by an earlier round that can carry ``count`` more
        messages (``connection.SessionCache``); else connect, read the greeting,
        EHLO, STARTTLS when offered (or when the TLS policy requires it: never
        cleartext then), AUTH when configured."""
        target = self.targets[index]
        state = self.states[index]
        req = self.requirement(target)
        if req.refuse:  # e.g. an MX that the MTA-STS policy does not list
            state.dead = True
            text = outcome.strip_enhanced(req.refuse)
            return self._fail(
                TargetFailure(
                    outcome.CONNECT, None, text, target, TLS_REQUIRED, TLS_ENHANCED, "", req.level
                )
            )
        key = None if self.cache is None else self._session_key(target, req, use_tls)
        if self.cache is not None and key is not None:
            kept = await self.cache.take(key, count, self.config.max_messages_per_connection)
            if kept is not None:
                kept.config = self.config  # this round's timeouts (the same TLS and AUTH)
                self.connected = True
                return kept
        opened = await self._connect(target, state, req)
        if isinstance(opened, TargetFailure):
            return opened
        opened.session_key = key
        return await self._start(opened, state, req, use_tls)

    def _session_key(self, target: Peer, req: TlsRequirement, use_tls: bool) -> tuple:
        """What a kept session must share with a new one to stand for it."""
        creds = self.config.auth_for(target) if self.config.auth_for is not None else None
        where = (target.host, target.ip, target.port)
        return (*where, req, creds, use_tls, self.config.source_address)

    async def _connect(
        self, target: Peer, state: _TargetState, req: TlsRequirement
    ) -> Connection | TargetFailure:
        """Connect (port 465: and shake hands); a failure marks the target dead."""
        cfg = self.config
        implicit = target.port == IMPLICIT_TLS_PORT
        try:
            async with asyncio.timeout(cfg.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    target.ip or target.host,
                    target.port,
                    limit=READ_LIMIT,
                    local_addr=_local_addr(cfg.source_address, target.ip or target.host),
                    ssl=context_for(req) if implicit else None,
                    server_hostname=sni(target.host) or target.host if implicit else None,
                )
        except ssl.SSLError as exc:  # implicit TLS (port 465): the handshake failed
            state.dead = True
            return self._fail(
                TargetFailure(
                    outcome.STARTTLS,
                    None,
                    f"TLS handshake failed (implicit TLS, port {target.port}): {exc}",
                    target,
                    TLS_REQUIRED,
                    TLS_ENHANCED,
                    "",
                    req.level,
                )
            )
        except TimeoutError:
            state.dead = True
            return self._fail(
                TargetFailure(
                    outcome.CONNECT,
                    None,
                    f"connect timeout after {cfg.connect_timeout:g}s",
                    target,
                    "timeout_connect",
                )
            )
        except Exception as exc:  # noqa: BLE001 - refused, unreachable, DNS
            state.dead = True
            errno = getattr(exc, "errno", None)
            why = os.strerror(errno) if errno else str(exc) or type(exc).__name__
            return self._fail(
                TargetFailure(outcome.CONNECT, None, f"connect failed: {why}", target, "refused")
            )

        conn = Connection(reader, writer, target, cfg)
        conn.security.policy = req.level
        if implicit:
            conn.tls_established()
        return conn

    async def _start(
        self, conn: Connection, state: _TargetState, req: TlsRequirement, use_tls: bool
    ) -> Connection | TargetFailure:
        """Greeting, EHLO, STARTTLS (``_secure``) and AUTH on a new connection."""
        cfg = self.config
        target = conn.target
        try:
            try:
                async with asyncio.timeout(cfg.command_timeout):
                    greeting = await conn.reply("greeting")
            except Exception as exc:  # noqa: BLE001
                state.dead = True
                raise conn.lost(exc, outcome.GREETING, cfg.command_timeout) from exc
            if greeting.code // 100 != 2:
                # A 4xx/5xx greeting may be per connection (too many from us),
                # so the target stays available to the other connections.
                raise SessionFailed(outcome.GREETING, greeting.code, greeting.text)
            self.connected = True
            await conn.hello(outcome.EHLO)
            await self._secure(conn, state, req, use_tls)
            creds = cfg.auth_for(target) if cfg.auth_for is not None else None
            if creds is not None:
                try:
                    await authenticate(conn, creds)
                except SessionFailed as exc:
                    if exc.error:  # refused for good, or no way to send it: same next time
                        state.dead = True
                    raise
            return conn
        except SessionFailed as exc:
            if exc.protocol:
                # It would do the same to every connection of this batch.
                state.dead = True
            await discard(conn, polite=exc.code is not None)
            return self._fail(TargetFailure.of(exc, target, req.level, conn.security))
        except Exception as exc:  # a bug must not escape as an exception
            log.exception("unexpected error opening %s", target.host)
            conn.abort()
            return self._fail(
                TargetFailure(outcome.SESSION, None, f"internal error: {exc!r}", target)
            )
        except BaseException:  # cancelled: leave no socket behind
            conn.abort()
            raise

    async def _secure(
        self, conn: Connection, state: _TargetState, req: TlsRequirement, use_tls: bool
    ) -> None:
        """STARTTLS as the policy says. At ``may`` a broken handshake is
        retried later in cleartext (``tls_broken``); when TLS is required a
        missing or failed TLS is a per-connection failure (4.7.5,
        ``tls_required``) and the target is not tried again in this round."""
        host = conn.target.host
        offered = "STARTTLS" in conn.extensions
        if not conn.tls and req.level != "none" and offered and (use_tls or req.require):
            try:
                await conn.starttls(context_for(req))
            except SessionFailed as exc:
                if exc.code is None and req.require:
                    state.dead = True
                    raise SessionFailed(
                        outcome.STARTTLS,
                        None,
                        f"TLS required ({req.level}) but the TLS handshake with {host} "
                        f"failed: {exc.text.removeprefix('TLS handshake failed: ')}",
                        error=TLS_REQUIRED,
                        enhanced=TLS_ENHANCED,
                    ) from exc
                if exc.code is None:
                    state.tls_broken = True
                raise
        if req.verify == "report" and not conn.tls:
            conn.security.report = (
                f"{host} offered no STARTTLS" if not offered else (f"no TLS with {host}")
            )
        if req.require and not conn.tls:
            state.dead = True
            raise SessionFailed(
                outcome.STARTTLS,
                None,
                f"TLS required ({req.level}) but not offered by {host}",
                error=TLS_REQUIRED,
                enhanced=TLS_ENHANCED,
            )
        if conn.tls:
            try:
                conn.check_peer(req)
            except SessionFailed:
                state.dead = True
                raise

    async def run_group(self, group: list[OutboundMessage]) -> None:
        """Deliver one connection's messages, walking the targets.

        Steps:
        1. take the next candidate target and open a session (connect,
           greeting, EHLO/HELO, STARTTLS); on failure remember it and go on;
        2. send the messages one after the other over that session, RSET
           first when the previous transaction was left open;
        3. when the session breaks (no reply, timeout, 421) the message in
           progress is deferred with that error and the rest continue on
           the next target;
        4. when no target is left, every remaining message is deferred with
           the last connection error (which becomes the batch's error).
        """
        remaining = deque(group)
        group_started = clock.now()
        group_t0 = time.monotonic()
        failure: TargetFailure | None = None
        for index, use_tls in self.candidates():
            if not remaining or not self.owner():
                break
            opened = await self.open(index, use_tls, len(remaining))
            if isinstance(opened, TargetFailure):
                failure = opened
                continue
            failure = await self._session(opened, remaining)
        # Messages never started get no result once the round lost ownership.
        if remaining and self.owner():
            self._defer_remaining(remaining, failure, group_started, group_t0)

    async def _session(
        self, conn: Connection, remaining: deque[OutboundMessage]
    ) -> TargetFailure | None:
        rec: Recorder | None = None
        conn.may_send = self.owner
        recorded: Awaitable[object] | None = None
        ahead: asyncio.Future[bytes] | None = None  # the next body, read meanwhile
        try:
            while remaining and self.owner():
                if recorded is not None:
                    # The previous message's outcome is durable before the next
                    # transaction starts: a crash re-sends at most one message
                    # per open connection. The next body is read meanwhile.
                    ahead = self._read_ahead(remaining[0])
                    await recorded
                    recorded = None
                    continue  # ownership is asked again
                if conn.need_rset:
                    await conn.rset()
                rec = Recorder(
                    remaining[0],
                    conn.target,
                    clock.now(),
                    time.monotonic(),
                    peer_dsn="DSN" in conn.extensions,
                    security=conn.security,
                )
                load = self.load_body if ahead is None else _given(ahead)
                ahead = None
                await conn.send(remaining[0], rec, load)
                conn.sent += 1
                done = rec.results()
                self.results.extend(done)
                if self.on_sent is not None and done:
                    recorded = self.on_sent(done)  # recorded now, not when the round ends
                remaining.popleft()
                rec = None
            if recorded is not None:
                await recorded
            if not (self.cache is not None and self.owner() and self.cache.keep(conn)):
                await conn.quit()
            return None
        except ClaimLost as exc:
            # Nothing of the message in progress is recorded: its recipients
            # have (or will have) a new owner, and the next hop has no copy.
            log.warning("delivery to %s stopped %s: the claim was lost", conn.target.host, exc)
            conn.abort()
            return None
        except SessionFailed as exc:
            conn.abort()
            if rec is not None:
                rec.fill(exc.phase, exc.code, exc.text + exc.note, exc.enhanced)
                self.results.extend(rec.results())
                remaining.popleft()
            return self._fail(
                TargetFailure.of(exc, conn.target, conn.security.policy, conn.security)
            )
        except Exception as exc:  # a bug must not lose results or escape
            log.exception("unexpected error delivering to %s", conn.target.host)
            conn.abort()
            text = f"internal error: {exc!r}"
            if rec is not None:
                rec.fill(outcome.SESSION, None, text)
                self.results.extend(rec.results())
                remaining.popleft()
            return self._fail(TargetFailure(outcome.SESSION, None, text, conn.target))
        except BaseException:  # cancelled: leave no socket behind
            conn.abort()
            raise
        finally:
            if ahead is not None:
                ahead.cancel()  # not sent: its body is dropped

    def _read_ahead(self, msg: OutboundMessage) -> asyncio.Future[bytes] | None:
        """Start reading ``msg``'s body while the previous message's outcome
        commits, so the next MAIL FROM waits for the commit only. Still at most
        one body per connection: the previous one was dropped after its dot."""
        if msg.data is not None or self.load_body is None:
            return None
        future = asyncio.ensure_future(self.load_body(msg))
        future.add_done_callback(_retrieve)  # a read never used logs nothing
        return future

    def _defer_remaining(
        self,
        remaining: deque[OutboundMessage],
        failure: TargetFailure | None,
        started: datetime,
        t0: float,
    ) -> None:
        failure = failure or self.last_failure
        if failure is None:  # no target at all
            failure = TargetFailure(outcome.CONNECT, None, "no host to deliver to", NoPeer())
        self.connection_error = failure.describe()
        security = failure.security or Security(policy=failure.tls_policy)
        for msg in remaining:
            rec = Recorder(msg, failure.target, started, t0, security=security)
            rec.fill(failure.phase, failure.code, failure.text, failure.enhanced)
            self.results.extend(rec.results())
        remaining.clear()


def _given(future: asyncio.Future[bytes]) -> LoadBody:
    """A ``load_body`` that gives what ``_read_ahead`` read (or its error), once,
    and keeps no reference to it: the body must go when the connection drops
    it after the final dot, not live on in the future that read it."""
    held = [future]

    async def load(_msg: OutboundMessage) -> bytes:
        return await held.pop()

    return load


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def deliver(
    targets: Sequence[Peer],
    messages: Sequence[OutboundMessage],
    config: ClientConfig,
    *,
    still_owner: StillOwner | None = None,
    load_body: LoadBody | None = None,
    on_sent: OnSent | None = None,
    cache: SessionCache | None = None,
) -> BatchResult:
    """Deliver ``messages`` to one destination, trying ``targets`` in order.

    ``still_owner()`` (cheap, synchronous) is asked before opening each
    connection, before each MAIL FROM and before each final dot; once it says
    False nothing more is sent: a transaction past 354 is dropped without its
    final dot (the connection is closed: the next hop delivers nothing), the
    messages not finished get no result at all and ``abandoned`` is set.

    ``load_body(msg)`` gives the bytes of a message whose ``data`` is None;
    it is awaited when that message is about to be sent (the bytes are
    needed for MAIL's SIZE and the SMTPUTF8 check) and the bytes are dropped
    when its transaction is over: at most one body per open connection. When
    it raises, that message is deferred (4.3.0) and the session goes on.

    ``on_sent(results)`` (cheap, synchronous) is called with a message's
    results as soon as its transaction is over, so the caller can record a
    delivery before the round ends; when it returns an awaitable, the
    connection awaits it before its next transaction (the outcome is durable
    first: a crash re-sends at most the message in flight on each
    connection). The returned ``BatchResult`` still holds every result.

    ``cache`` (a ``connection.SessionCache``, whose loop runs this coroutine)
    keeps the sessions that finished their group for the task's next round,
    and gives this round those an earlier one kept.

    Steps:
    1. split the messages into balanced groups of at most
       ``group_size`` (spread over the connections, at least
       ``MIN_MESSAGES_PER_CONNECTION`` and at most ``max_messages_per_connection``
       each), one group per connection;
    2. run up to ``max_connections`` connections at once, each taking the
       next group while groups remain and the round is still the owner
       (``_Batch.run_group``);
    3. return one result per recipient of every message attempted (of every
       message unless abandoned), whether any connection got a 2xx greeting,
       and the last connection error when some messages found no usable target.

    Never raises for network problems; cancellation propagates.
    """
    batch = _Batch(targets, config, still_owner, load_body, on_sent, cache)
    groups = deque(_split_groups(messages, group_size(len(messages), config)))

    async def worker() -> None:
        while groups and batch.owner():
            await batch.run_group(groups.popleft())

    workers = connections_for(len(messages), config)
    if workers:
        await asyncio.gather(*(worker() for _ in range(workers)))
    return BatchResult(
        results=batch.results,
        connected=batch.connected,
        connection_error=batch.connection_error,
        host_failures=batch.host_failures,
        abandoned=batch.abandoned,
    )


# --- the round's TLS plan and next-hop AUTH, worked out before it sends ---------------
#
# What each target requires: ``plan`` looks it all up before a round sends (the
# policy file, DANE and MTA-STS: DNS and HTTPS, bounded by timeouts; the MTA-STS
# part through the round's ``wait``, which keeps its claim renewed), and the next
# hops' AUTH credentials with it; the connections only read the result
# (``RoundTls.tls_for``, ``RoundTls.auth_for``, through ``ClientConfig``). The
# levels, the two files' formats and what DANE and MTA-STS require are
# ``delivery.smtp.tls``'s.


def requirement(level: str, ca_file: str = "") -> TlsRequirement:
    """The requirement of a level without DNS data (not for dane levels)."""
    if level in ("verify", "secure"):
        return TlsRequirement(level, True, "ca", ca_file=ca_file)
    if level == "encrypt":
        return TlsRequirement(level, True)
    return TlsRequirement(level)


_loaded: tuple[tuple[str, float], dict[str, str]] | None = None


def load_policy() -> dict[str, str]:
    """The table of ``MAILRELAY_TLS_POLICY``, read again when the file changes."""
    global _loaded
    path = round_settings().tls_policy
    if not path:
        return {}
    stamp = (path, os.stat(path).st_mtime)
    if _loaded is None or _loaded[0] != stamp:
        with open(path, encoding="utf-8") as fh:
            _loaded = (stamp, parse_policy(fh.read()))
    return _loaded[1]


def _domain_keys(domain: str) -> Iterable[str]:
    """``a.b.com``, then ``.b.com``, then ``.com`` (Postfix: ``.domain`` matches
    subdomains only)."""
    domain = domain.rstrip(".").lower()
    yield domain
    labels = domain.split(".")
    for i in range(1, len(labels)):
        yield "." + ".".join(labels[i:])


def level_for(
    table: dict[str, str], domains: Iterable[str], hop_names: Iterable[str]
) -> str | None:
    """The strictest level configured for the round's next hops and domains,
    or None when no line applies."""
    found = [table[name.lower()] for name in hop_names if name.lower() in table]
    for domain in domains:
        for key in _domain_keys(domain):
            if key in table:
                found.append(table[key])
                break
    return max(found, key=STRICTNESS.__getitem__) if found else None


def _names(host: str, port: int) -> list[str]:
    """The ways a next hop may be written, most specific first."""
    return [f"[{host}]:{port}", f"[{host}]", f"{host}:{port}", host]


@dataclass
class RoundTls:
    """The TLS requirement and AUTH credentials per target for one round."""

    default: TlsRequirement = MAY
    by_target: dict[tuple[str, int], TlsRequirement] = field(default_factory=dict)
    auth: dict[tuple[str, int], Credentials] = field(default_factory=dict)
    # MTA-STS "testing" failures, for the operator (queues Event)
    reports: list[str] = field(default_factory=list)

    def tls_for(self, peer) -> TlsRequirement:
        return self.by_target.get((peer.host, peer.port), self.default)

    def auth_for(self, peer) -> Credentials | None:
        return self.auth.get((peer.host, peer.port))


def plan(
    link_hops: Sequence,
    dns_routed: bool,
    domains: Sequence[str],
    targets: Sequence,
    now: datetime,
    wait: Callable | None = None,
) -> RoundTls:
    """Work out, before a round, what each target requires (above; the levels in
    ``delivery.smtp.tls``'s doc).

    ``link_hops`` are the link's ``NextHop``s, ``targets`` the addresses the
    client will try (``routing.Target``: host, ip, port). ``wait`` runs the
    MTA-STS lookups and fetches (``mta_sts.policy_for``): a round passes one
    that renews its claim meanwhile.
    """
    config = round_settings()
    ca_file = config.tls_ca_file
    hops = list(link_hops)
    if not dns_routed:  # the hops as written too, when an MX lookup expanded them
        hops += [hop for domain in domains for hop in configured_hops(domain)]
    hop_names = list(
        dict.fromkeys(n for hop in hops for n in [hop_label(hop), *_names(hop.host, hop.port)])
    )
    configured = level_for(load_policy(), domains, hop_names)
    level = configured or config.tls_default_level
    rnd = RoundTls(default=requirement(level, ca_file))
    hosts = sorted({(t.host, t.port) for t in targets})
    if level in ("dane", "dane-only"):
        rnd.default, rnd.by_target = dane_requirements(level, hosts)
    elif configured is None and dns_routed and config.mta_sts:
        rnd.by_target, rnd.reports = mta_sts_requirements(domains, hosts, now, ca_file, wait)
    table = load_auth()
    if table:
        for host, port in hosts:
            creds = lookup_auth(table, _names(host, port) + hop_names)
            if creds is not None:
                rnd.auth[(host, port)] = creds
    return rnd


_auth_loaded: tuple[tuple[str, float], dict[str, Credentials]] | None = None


def load_auth() -> dict[str, Credentials]:
    """The table of ``MAILRELAY_SMTP_AUTH`` (a path, or the content from a
    ``_FILE`` secret), read again when the file changes."""
    global _auth_loaded
    value = round_settings().smtp_auth
    if not value.strip():
        return {}
    path = value.strip()
    if any(ch.isspace() for ch in path):  # content (a _FILE secret), not a path
        return parse_auth(value)
    if not os.path.isfile(path):
        raise ValueError(f"file {path!r} does not exist")
    stamp = (path, os.stat(path).st_mtime)
    if _auth_loaded is None or _auth_loaded[0] != stamp:
        with open(path, encoding="utf-8") as fh:
            _auth_loaded = (stamp, parse_auth(fh.read()))
    return _auth_loaded[1]
