"""Delivery of one link: claim due recipients, send them, record what happened."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime
from functools import partial

from django.db import connection, transaction

from delivery.route.routing import DNS_MX, NextHop, order_targets
from delivery.shaping import gate as shaping_gate
from delivery.smtp.client import connections_for, deliver, plan
from delivery.smtp.clientconfig import ClientConfig
from delivery.smtp.config import round_settings
from delivery.smtp.connection import SessionCache
from delivery.smtp.outcome import (
    Carried,
    Round,
    attempt_values,
    decide,
    forget_hints,
    link_outcome,
    reply_host,
    store_hints,
    stored_hints,
    unattempted,
    usable_targets,
)
from delivery.smtp.types import BatchResult, OutboundMessage, OutboundRecipient, RecipientResult
from queues import transitions
from queues.bounce import dsn
from queues.bounce.notify import notify
from queues.config import once_per_process, store_settings
from queues.database import insert_all, is_outage, pipelined
from queues.lib import DSN_SUCCESS, clock, dsn_wanted, scrub_nul
from queues.models import (
    AttemptOutcome,
    DeliveryType,
    Event,
    EventLevel,
    Link,
    Message,
    Recipient,
)
from queues.outcomes import Delivered
from queues.placement import park_poison, special_queue
from queues.signals import attempts_recorded
from queues.transitions import Claim, deliveries_heard, while_connected, while_renewing

log = logging.getLogger(__name__)

# The SMTP client's limits (timeouts, connections, messages a connection), once per process.
client_config = once_per_process(ClientConfig.from_settings)


def link_acquire(link_id: int, owner: str) -> bool:
    """Become (or stay) the one delivery task of this link, for one lease."""
    return Link.objects.acquire(link_id, owner, clock.now(), store_settings().lease)


def link_release(link_id: int, owner: str) -> None:
    Link.objects.release(link_id, owner)


def link_has_due_work(link_id: int, now: datetime | None = None) -> bool:
    now = now or clock.now()
    link = Link.objects.filter(pk=link_id).values("next_retry_at").first()
    if link is None or (link["next_retry_at"] and link["next_retry_at"] > now):
        return False
    return Recipient.objects.due_on_link(link_id, now).exists()


def claim_round(link_id: int, owner: str, limit: int, again: bool = False) -> list[int]:
    """Lease up to ``limit`` due recipients (and MAILRELAY_DELIVERY_ROUND_BYTES of
    messages) to the round ``owner``; its results are written only to rows that
    still carry that owner (queues.transitions). ``again``: a retry after the
    connection broke, which takes what the first try may have committed."""
    return Recipient.objects.claim_on_link(
        link_id,
        owner,
        clock.now(),
        store_settings().lease,
        limit=limit,
        max_bytes=round_settings().round_bytes,
        again=again,
    )


# Small bodies are read with the round's envelopes, in the same query, up to
# PRELOAD_BYTES in all (one query instead of one per message, for the usual
# small mail); larger ones are read when their connection is about to send
# them, while its previous message's record commits (_read_bodies: the bodies
# asked for at once in one SELECT).
PRELOAD_MESSAGE_BYTES = 64 * 1024
PRELOAD_BYTES = 4 * 1024 * 1024


def _load_batch(recipient_ids: list[int]) -> list[OutboundMessage]:
    """The round's envelopes, with the bodies of its small messages (see
    PRELOAD_BYTES); the others are read when sent."""
    rows = Recipient.objects.filter(id__any=recipient_ids).order_by("message_id", "id")
    by_message: dict[int, list[OutboundRecipient]] = defaultdict(list)
    for rid, mid, address, orcpt, notify_ in rows.values_list(
        "id", "message_id", "address", "orcpt", "notify"
    ):
        by_message[mid].append(OutboundRecipient(rid, address, orcpt, notify_))
    envelopes = list(
        Message.objects.filter(id__any=list(by_message))
        .order_by("id")
        .values(
            "id", "mail_from", "body_type", "smtputf8", "ret", "envid", "size", "qid", "message_id"
        )
    )
    preload, budget = [], PRELOAD_BYTES
    for m in envelopes:
        if m["size"] <= PRELOAD_MESSAGE_BYTES and m["size"] <= budget:
            preload.append(m["id"])
            budget -= m["size"]
    bodies: dict[int, bytes] = {}
    if preload:
        for mid, signature, data in Message.objects.filter(id__any=preload).values_list(
            "id", "signature", "data"
        ):
            bodies[mid] = b"".join((signature, data)) if signature else bytes(data)
    return [
        OutboundMessage(
            id=m["id"],
            mail_from=m["mail_from"],
            data=bodies.get(m["id"]),
            recipients=by_message[m["id"]],
            body_type=m["body_type"],
            smtputf8=m["smtputf8"],
            ret=m["ret"],
            envid=m["envid"],
            qid=m["qid"],
            header_id=m["message_id"],
        )
        for m in envelopes
    ]


def _read_bodies(message_ids: list[int]) -> dict[int, bytes]:
    """What leaves for the next hop, by message id, in one SELECT on the owner's
    connection: the header fields added for sending (a DKIM-Signature,
    queues.dkim) before the stored bytes, which stay as received. A message no
    longer stored is not in the answer."""
    rows = Message.objects.filter(pk__in=message_ids).values_list("id", "signature", "data")
    # join copies each piece once (no bytes() of the body first).
    return {
        mid: b"".join((signature, data)) if signature else bytes(data)
        for mid, signature, data in rows
    }


def _exchange(
    targets: list,
    messages: list[OutboundMessage],
    config: ClientConfig,
    claim: Claim,
    record_early: Callable[[list[RecipientResult]], None] | None = None,
    cache: SessionCache | None = None,
) -> BatchResult:
    """Run the SMTP exchange of one round on an event loop (the ``cache``'s,
    which keeps the task's idle sessions, else its own) while this thread (the
    owner, holding the database connection) renews the claim, reads each body
    when the client is about to send it, and records each finished message.

    The claim stays renewed while this process lives, however long the peers
    take; the client starts nothing more once it is no longer held
    (``Claim.held``). A finished message's results are committed
    (``record_early``) before its connection starts the next transaction:
    those that arrive while one commit runs go together in the next, so a
    process killed in the middle of a round re-sends at most the message in
    flight on each open connection.
    """
    requests: queue.SimpleQueue = queue.SimpleQueue()  # body requests, sent results, None
    outcome: concurrent.futures.Future[BatchResult] = concurrent.futures.Future()

    async def load_body(message: OutboundMessage) -> bytes:
        future: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        requests.put((message.id, future))
        return await asyncio.wrap_future(future)

    def on_sent(results: list[RecipientResult]) -> asyncio.Future:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        requests.put(("sent", results, future))
        return asyncio.wrap_future(future)

    def run() -> None:
        try:
            exchange = deliver(
                targets,
                messages,
                config,
                still_owner=claim.held,
                load_body=load_body,
                on_sent=on_sent if record_early is not None else None,
                cache=cache,
            )
            outcome.set_result(cache.run(exchange) if cache else asyncio.run(exchange))
        except BaseException as exc:  # noqa: BLE001 - handed to the owner thread
            outcome.set_exception(exc)
        finally:
            requests.put(None)

    gather = RECORD_GATHER if connections_for(len(messages), config) > 1 else 0.0
    loop_thread = threading.Thread(target=run, name="smtp-round", daemon=True)
    loop_thread.start()
    backlog: deque = deque()
    while True:
        if backlog:
            item = backlog.popleft()
        else:
            try:
                item = requests.get(timeout=max(0.01, claim.seconds_to_renewal()))
            except queue.Empty:
                claim.renew_if_due()
                continue
        if item is None:
            break
        if item[0] == "sent":
            backlog.extend(_record_waiting(requests, item, record_early, gather))
            claim.renew_if_due()
            continue
        _give_bodies(claim, _bodies_wanted(item, backlog, requests))
        claim.renew_if_due()
    loop_thread.join()
    return outcome.result()


def _bodies_wanted(first: tuple, backlog: deque, requests: queue.SimpleQueue) -> list:
    """``first`` (a body request) with every other one asked for by now, to read
    in one SELECT: those leading the backlog, then, when the backlog is empty
    (what waits there goes first), those waiting in ``requests``; the first
    other request taken from there goes to the backlog."""
    wanted = [first]
    while backlog and backlog[0] is not None and backlog[0][0] != "sent":
        wanted.append(backlog.popleft())
    while not backlog:
        try:
            item = requests.get_nowait()
        except queue.Empty:
            break
        if item is None or item[0] == "sent":
            backlog.append(item)
        else:
            wanted.append(item)
    return wanted


def _give_bodies(claim: Claim, wanted: list) -> None:
    """Read the bodies asked for (``_read_bodies``) and hand each to its
    connection; a body no longer wanted (its connection stopped) is skipped."""
    wanted = [(mid, future) for mid, future in wanted if future.set_running_or_notify_cancel()]
    if not wanted:
        return
    try:
        bodies = while_connected(claim, lambda: _read_bodies([mid for mid, _ in wanted]))
    except Exception as exc:  # noqa: BLE001 - the client defers those messages
        for _, future in wanted:
            future.set_exception(exc)
        return
    for mid, future in wanted:
        body = bodies.get(mid)
        if body is None:
            future.set_exception(LookupError(f"message {mid} is no longer stored"))
        else:
            future.set_result(body)


def _record_waiting(
    requests: queue.SimpleQueue,
    first: tuple,
    record_early: Callable[[list[RecipientResult]], None] | None,
    gather: float = 0.0,
) -> list:
    """Commit ``first`` (a "sent" request of ``_exchange``) and every other result
    that arrives within ``gather`` seconds, in one go; returns the other
    requests taken meanwhile, in order."""
    sent, futures, others = list(first[1]), [first[2]], []
    deadline = time.monotonic() + gather
    while True:
        try:
            wait = deadline - time.monotonic()
            item = requests.get(timeout=wait) if wait > 0 else requests.get_nowait()
        except queue.Empty:
            break
        if item is not None and item[0] == "sent":
            sent.extend(item[1])
            futures.append(item[2])
        else:
            others.append(item)
    try:
        if record_early is not None:
            record_early(sent)
    finally:
        for future in futures:
            future.set_result(None)  # the connections go on
    return others


# Each finished message is recorded before its connection goes on (tests that
# count one round's statements turn it off: the early records' number is timing).
RECORD_EACH_MESSAGE = True
# How long an early record waits for the other connections' results to join
# its commit (PostgreSQL's commit_delay, for the same reason): each record is
# a transaction of a few statements whatever it holds, so at saturation fewer,
# larger records cost less CPU per message; a connection waits at most this
# much longer for its record. Only when the round has several connections.
# Measured: bench/README.md "Session 7".
RECORD_GATHER = 0.001


def _record(
    link: Link,
    batch: BatchResult,
    owner: str,
    *,
    final: bool = True,
    carried: Carried | None = None,
) -> None:
    """Record one round's outcome: read what it needs, decide (``decide``),
    write it all in one transaction (``_write``).

    ``final`` False: an early record of finished messages while the round goes
    on; what it owes the link, the queues and the retry data is kept in
    ``carried`` for the final record, which writes it with its own."""
    now = clock.now()
    if final:
        link.refresh_from_db()  # a retried recording starts again from the stored link
    if final and carried is not None:
        batch = carried.unrecorded(batch)  # the early records wrote the others
    for res in batch.results:
        res.text, res.host = scrub_nul(res.text), scrub_nul(res.host)
    batch.connection_error = scrub_nul(batch.connection_error)
    ids = [x.recipient_id for x in batch.results]
    claimed = Recipient.objects.filter(id__any=ids).owned_by(owner)
    # The rows, their messages' senders and tracking facts: one SELECT (none if none left).
    read = claimed.select_related("message").only(*_RECIPIENT_READ_FIELDS, *_MESSAGE_FACTS)
    rows: dict[int, Recipient] = {}
    facts: dict[int, tuple[str, str, str]] = {}
    for r in read if batch.results else ():
        m = r.message
        facts[m.pk] = (m.qid, m.mail_from, m.message_id)
        del r._state.fields_cache["message"]  # the rows are written back without it
        rows[r.id] = r
    senders = {mid: fact[1] for mid, fact in facts.items()}
    hints = stored_hints(f for f in batch.host_failures if f.host)
    rnd = decide(link, batch, rows, senders, hints, now)
    if final and carried is not None:
        carried.give(rnd)
    _write(rnd, link, batch, owner, final=final, facts=facts)
    if not final and carried is not None:
        carried.keep(rnd)  # after the commit: a retried early record keeps it once


_MESSAGE_FACTS = ("message__qid", "message__mail_from", "message__message_id")
_RECIPIENT_READ_FIELDS = (
    "id",
    "message_id",
    "address",
    "orcpt",
    "notify",
    "attempt_count",
    "first_failure_at",
    "last_attempt_at",
    "next_attempt_at",
    "queue_id",
)


def _write(
    rnd: Round,
    link: Link,
    batch: BatchResult,
    owner: str,
    *,
    final: bool = True,
    facts: dict[int, tuple[str, str, str]] | None = None,
) -> None:
    """Write what ``decide`` decided, in one transaction, only to rows the round
    still owns: attempts, recipients, retry data, the NDRs and "relayed" DSNs
    owed, problem-message counters, finished messages, the link and its queues.
    ``facts``: qid, sender and Message-ID of the round's messages (tracking)."""
    now = rnd.now
    rows = rnd.rows
    with transaction.atomic():
        dead_letter = (
            special_queue(DeliveryType.DEAD_LETTER, now).pk if any(rnd.failed.values()) else None
        )
        # Write (and lock) only rows whose claim is still ours, in the same
        # statement: rows the sweep took back meanwhile keep their newer
        # state; the attempts stay.
        kept = Recipient.objects.record_round(rows, rnd.outcome.recipients, owner, dead_letter, now)
        if len(kept) != len(rows):
            rows = {rid: row for rid, row in rows.items() if rid in kept}
            for per_message in (rnd.failed, rnd.relayed):
                for mid in list(per_message):
                    per_message[mid] = [r for r in per_message[mid] if r.id in kept]
        insert_all(rnd.attempts)
        # One row per attempt; a recipient whose claim was lost meanwhile (not
        # in ``kept``): its attempt is recorded, its fate is the new owner's.
        attempts_recorded.send(
            None, attempts=rnd.attempts, rows=rnd.rows, link=link, now=now, facts=facts, owned=kept
        )
        if final:
            # Claimed but never tried (the round stopped when it lost its claim,
            # or a peer never got to them): waiting again, due now.
            Recipient.objects.owned_by(owner).release(now)
        _write_hints(rnd, forget=final)
        _notify_round(rnd)
        Message.objects.count_message_failures(rnd.outcome.message_failures)
        Message.objects.finish_ids({r.message_id for r in batch.results}, now)
        if final:
            Link.objects.record_round(link, link_outcome(rnd, batch.connection_error), now)


def _write_hints(rnd: Round, *, forget: bool = True) -> None:
    """The round's retry data, in a savepoint: it is a hint (deleting it is always
    safe), so data that cannot be written is logged and dropped, never the
    round's recorded outcomes with it. A lost connection is still an outage."""
    if forget and rnd.cleared_hints:
        forget_hints(rnd.cleared_hints)  # a DELETE by bounded keys: cannot fail on data
    if not rnd.hints:
        return
    try:
        with transaction.atomic():
            store_hints(rnd.hints)
    except Exception as exc:
        if is_outage(exc):
            raise
        log.exception("the retry data of a delivery round could not be written; dropped")


def _notify_round(rnd: Round) -> None:
    ids = set(rnd.failed) | set(rnd.relayed)
    if not ids:
        return
    # Without bodies: notify reads the one original it quotes, when it quotes it.
    originals = Message.objects.filter(id__in=ids).exclude(mail_from="").defer("data")
    for message in originals.iterator():
        if rnd.failed.get(message.pk):
            notify(dsn.FAILURE, message, rnd.failed[message.pk], now=rnd.now)
        if rnd.relayed.get(message.pk):
            notify(dsn.SUCCESS, message, rnd.relayed[message.pk], now=rnd.now)


def deliver_round(
    link: Link, config: ClientConfig, owner: str, claim: Claim, cache: SessionCache | None = None
) -> int:
    """Claim, send and record one round for ``link`` as ``owner`` (over the
    sessions ``cache`` kept from the task's earlier rounds, when given).

    Returns how many recipients the round claimed (0: nothing was due, or the
    shaping policy says not now: delivery.shaping.gate).
    """
    # No MAILRELAY_SHAPING: the built-in limits, and the gate is not consulted.
    shaped = shaping_gate.open_round(link, config, owner) if round_settings().shaping else None
    if shaped is None:
        return _deliver_round(link, config, owner, claim, None, cache)
    if shaped.refused:
        return 0
    try:
        return _deliver_round(link, shaped.config, owner, claim, shaped)
    finally:
        shaped.close()


def _deliver_round(
    link: Link,
    config: ClientConfig,
    owner: str,
    claim: Claim,
    shaped: shaping_gate.ShapedRound | None,
    cache: SessionCache | None = None,
) -> int:
    limit = config.max_connections * config.max_messages_per_connection
    if shaped is not None:
        limit = shaped.limit
    # The round's reads ride out a database restart as its writes do (while
    # the link's claim is held): an outage here must not end the task.
    tries = itertools.count()
    ids = while_connected(claim, lambda: claim_round(link.pk, owner, limit, next(tries) > 0))
    if not ids:
        return 0
    messages = while_connected(claim, lambda: _load_batch(ids))
    carried = Carried()
    index = {r.id: (r, m) for m in messages for r in m.recipients}
    if shaped is not None:
        config = shaped.claimed(messages)
    hops = [NextHop.from_json(h) for h in link.hosts]
    targets, error = order_targets(hops)
    domain = messages[0].recipients[0].address.rpartition("@")[2] if messages else link.name
    hints = while_connected(claim, lambda: stored_hints(targets))
    targets, verdict = usable_targets(targets, hints, domain=domain, now=clock.now())
    if verdict == "bounce":
        batch = unattempted(
            messages,
            AttemptOutcome.FAILED,
            "4.4.7",
            "retry time not reached for any host after a long failure period",
        )
    elif not targets:
        batch = unattempted(
            messages, AttemptOutcome.DEFERRED, "4.4.4", error or "no address for the next hop"
        )
    else:
        planned = _with_tls(link, hops, messages, targets, config, claim)
        if isinstance(planned, ClientConfig):
            batch = _exchange(
                targets,
                messages,
                planned,
                claim,
                (lambda done: _record_early(link, done, owner, claim, carried, index))
                if RECORD_EACH_MESSAGE
                else None,
                cache,
            )
            if shaped is not None:
                shaped.observe(batch)
        else:
            batch = unattempted(messages, AttemptOutcome.DEFERRED, "4.7.5", planned)
    try:
        while_connected(claim, lambda: _record(link, batch, owner, carried=carried))
    except Exception as exc:
        if is_outage(exc):
            # The database stayed away for a whole lease: the rows are (or will
            # be) taken back by the sweep and tried again; nothing to write here.
            log.exception("could not record a delivery round of link %s", link.pk)
        else:
            # Never retry the same batch in a tight loop: park it for a while, and
            # a message that keeps breaking the recording goes to Poison.
            log.exception("recording a delivery round of link %s failed", link.pk)
            try:  # one transaction, fenced by the owner: safe to repeat
                while_connected(claim, lambda: _record_crash(owner))
            except Exception:  # noqa: BLE001 - the lease and the reclaim take them back
                log.exception("could not park the round of link %s after that", link.pk)
    _report_tls(batch)  # after the record: a lost report must not cost a second copy
    return len(ids)


def _with_tls(
    link: Link,
    hops: list[NextHop],
    messages: list[OutboundMessage],
    targets: list,
    config,
    claim: Claim | None = None,
) -> ClientConfig | str:
    """``config`` with the round's TLS requirements and AUTH credentials
    (delivery.smtp.client.plan: policy file, MTA-STS, DANE, all looked up here,
    before the round sends; a recipient domain's MTA-STS server is waited for
    while ``claim`` is renewed); or why the round cannot go (then it is
    deferred: a policy that cannot be read must not become cleartext)."""
    domains = sorted({r.address.rpartition("@")[2].lower() for m in messages for r in m.recipients})
    wait = partial(while_renewing, claim) if claim is not None else None
    dns_routed = link.delivery_type == DNS_MX
    try:
        planned = plan(hops, dns_routed, domains, targets, clock.now(), wait)
    except Exception as exc:  # noqa: BLE001 - unreadable policy/credentials file
        log.exception("TLS policy of link %s could not be worked out", link.pk)
        return f"TLS policy could not be applied: {exc}"
    now = clock.now()
    for text in planned.reports:
        Event.objects.create(created_at=now, level=EventLevel.WARNING, kind="mta_sts", text=text)
    return replace(config, tls_for=planned.tls_for, auth_for=planned.auth_for)


def _report_tls(batch: BatchResult) -> None:
    """An Event per distinct MTA-STS "testing" failure of the round (none while
    the database is away: the log keeps them)."""
    now = clock.now()
    for text in dict.fromkeys(r.tls_report for r in batch.results if r.tls_report):
        try:
            Event.objects.create(
                created_at=now,
                level=EventLevel.WARNING,
                kind="mta_sts",
                text=f"MTA-STS (testing): {text}; delivered anyway",
            )
        except Exception as exc:
            if not is_outage(exc):
                raise
            log.warning("MTA-STS (testing) report not stored: %s (%s)", text, exc)


Index = dict[int, tuple[OutboundRecipient, OutboundMessage]]  # a round's, by recipient id


def _record_early(
    link: Link,
    results: list[RecipientResult],
    owner: str,
    claim: Claim,
    carried: Carried,
    index: Index,
) -> None:
    """Record finished messages while the round goes on (a peer answered, so the
    link is reachable); the round's final record skips them, as they are no
    longer the round's, and writes what they left it (``carried``). A failure
    here is not fatal: the final record retries.

    Deliveries that owe no "relayed" report are one statement of the store
    and their tracking rows (``_record_delivered``); the others are decided
    and written as the final record writes them."""
    quick: list[RecipientResult] = []
    rest: list[RecipientResult] = []
    postgresql = connection.vendor == "postgresql"
    for res in results:
        rcpt, message = index[res.recipient_id]
        plain = res.outcome == AttemptOutcome.DELIVERED and (
            res.peer_dsn or not dsn_wanted(DSN_SUCCESS, rcpt.notify, message.mail_from)
        )
        (quick if plain and postgresql else rest).append(res)
    if quick:
        _not_fatal(link, lambda: _record_quickly(link, quick, owner, claim, carried, index))
    if rest:
        _not_fatal(link, lambda: _record_decided(link, rest, owner, claim, carried))


def _not_fatal(link: Link, record: Callable[[], None]) -> None:
    try:
        record()
    except Exception:  # noqa: BLE001 - the final record writes them
        log.exception("recording finished messages of link %s early failed", link.pk)


def _record_quickly(
    link: Link,
    results: list[RecipientResult],
    owner: str,
    claim: Claim,
    carried: Carried,
    index: Index,
) -> None:
    """``_record_delivered``, never run twice: when the database went away (its
    COMMIT may have happened all the same), the decided path writes them, as it
    writes only rows the round still holds, once the database is back."""
    try:
        _record_delivered(link, results, owner, carried, index)
    except Exception as exc:
        if not is_outage(exc):
            raise
        log.warning("recording deliveries of link %s: the database went away; again", link.pk)
        _record_decided(link, results, owner, claim, carried)


def _record_decided(
    link: Link, results: list[RecipientResult], owner: str, claim: Claim, carried: Carried
) -> None:
    batch = BatchResult(results, connected=True)
    while_connected(claim, lambda: _record(link, batch, owner, final=False, carried=carried))


def _record_delivered(
    link: Link, results: list[RecipientResult], owner: str, carried: Carried, index: Index
) -> None:
    """Deliveries recorded by one statement of the store (``record_delivered``), its
    own transaction; with tracking rows to write for them (``deliveries_heard``),
    both in one transaction, as one pipeline. Never run twice for the same results
    (``_record_quickly``): its attempts and tracking rows would be written twice."""
    now = clock.now()
    for res in results:
        res.text, res.host = scrub_nul(res.text), scrub_nul(res.host)
    values = [attempt_values(res, now, link.pk) | {"last_host": reply_host(res)} for res in results]
    rows, facts = {}, {}
    for res in results:
        rcpt, m = index[res.recipient_id]
        rows[rcpt.id] = Delivered(rcpt.id, m.id, None, rcpt.address)
        facts[m.id] = (m.qid, m.mail_from, m.header_id)
    heard = deliveries_heard()  # else nothing but the statement: autocommit
    with transaction.atomic() if heard else nullcontext(), pipelined() if heard else nullcontext():
        written = Recipient.objects.record_delivered(values, owner, now)
        attempts_recorded.send(
            None,
            attempts=results,
            rows=rows,
            link=link,
            now=now,
            facts=facts,
            own_savepoint=False,  # a failed tracking write: the final record writes all
        )
    senders = {mid: fact[1] for mid, fact in facts.items()}
    carried.keep_delivered(written(), results, senders)  # after the commit


def _record_crash(owner: str) -> None:
    now = clock.now()
    with transaction.atomic():
        rows = Recipient.objects.owned_by(owner)
        message_ids = set(rows.values_list("message_id", flat=True))
        rows.release_after_crash(
            owner,
            now + round_settings().message_retry_interval,
            "internal error while recording the delivery; will retry",
        )
        poisoned = Message.objects.filter(id__in=message_ids).count_crash()
    if poisoned:
        park_poison(poisoned)


class _LinkOwner:
    """What one delivery task holds: its link, renewed with its current round."""

    def __init__(self, link_id: int, owner: str) -> None:
        self.link_id = link_id
        self.owner = owner
        self.rounds = 0
        self.round: str | None = None
        # A rerun of the task after an outage keeps its owner (the link's lease
        # may be held already); its rounds are new, not an earlier run's.
        self.run = uuid.uuid4().hex[:4]
        self.lost = False  # the last claim on the link ran out

    def next_round(self) -> str:
        self.rounds += 1
        self.round = f"{self.owner}/{self.run}.{self.rounds}"
        return self.round

    def renew(self, until: datetime) -> bool:
        """Renew the link and the round's recipients (one lease end for both, so
        the sweep takes them back together: the link's answer says for both)."""
        if not Link.objects.renew(self.link_id, self.owner, until):
            return False
        if self.round is not None:
            Recipient.objects.renew(self.round, until)
            if round_settings().shaping:
                shaping_gate.renew(self.round, until.timestamp())  # its connection slots
        return True


_round_wait = time.sleep  # MAILRELAY_DELIVERY_ROUND_WAIT between rounds (tests watch it)


def deliver_link(link_id: int, owner: str | None = None) -> int:
    """Deliver everything due on one link, as its only delivery task; returns
    how many recipients were handled. Exits at once when another task holds
    the link, or when the link waits for its retry time. The sessions a round
    ends with go on in the next (not when shaping counts the connections); a
    task that lost its claim drops them without a word."""
    cache = None if round_settings().shaping else SessionCache()
    holder = _LinkOwner(link_id, owner or transitions.new_owner())
    try:
        return _deliver_link(holder, cache)
    finally:
        if cache is not None:
            cache.close(polite=not holder.lost)


def _deliver_link(holder: _LinkOwner, cache: SessionCache | None) -> int:
    link_id = holder.link_id
    handled = 0
    config = client_config()
    gather = round_settings().round_wait
    while True:
        acquired_at = time.monotonic()  # the link's lease runs from this request
        if not link_acquire(link_id, holder.owner):
            break
        before = handled
        claim = Claim(f"link {link_id}", holder.renew, acquired_at=acquired_at)
        try:
            count = 0
            while claim.held():
                if 0 < count < config.max_connections and gather > 0:
                    # The last round took all that was due and was small: let
                    # the next gather what arrives (one round's statements for
                    # more messages). Not after a larger round: that link is
                    # busy, a wait would leave it idle (bench/README.md "Session 9").
                    _round_wait(gather)
                link = while_connected(claim, lambda: Link.objects.get(pk=link_id))
                if link.next_retry_at and link.next_retry_at > clock.now():
                    break
                count = deliver_round(link, config, holder.next_round(), claim, cache)
                holder.round = None
                if not count:
                    break
                handled += count
                claim.renew_if_due()  # between rounds too: a lost link ends the task
        finally:
            holder.round = None
            holder.lost = not claim.held()
            link_release(link_id, holder.owner)
        # Work that arrived while we held the lease rang a bell we swallowed:
        # look once more after letting go.
        if handled == before or not link_has_due_work(link_id):
            break
    return handled
