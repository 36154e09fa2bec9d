"""The queue manager: the categorizer, and the engine's Celery tasks with the
doorbells that start them. The only Celery module of the engine.

**The categorizer** (``categorize_pending``, run by the task ``categorize``)
routes the recipients of submitted messages into delivery queues: it claims a
batch of Submission messages under a lease (``queues.transitions.flow.Claim``),
routes each distinct domain once (``delivery.route.routing``), places each
recipient in its destination's queue on its next hop's link, and rings the
links that got work. The delivery of a link is ``delivery.smtp.deliver``'s
(the task ``deliver_link``); the periodic ``sweep`` and ``reclaim`` are
``delivery.qmgr.sweep``'s.

Routed by name (``CELERY_TASK_ROUTES`` in mailrelay/settings.py): categorize
and sweep to the queue ``control`` (a prefork worker), deliver_link to
``delivery`` (a worker with a pool of threads: each task runs in a thread of
its own, with its own database connection, and waits on peers there).

**Doorbells.** Every stage says there is work by the store's work signals
(``queues.signals.categorizer_work``, ``link_work``), never by importing the
module that starts the next stage; ``delivery.apps`` connects them to
``ring_categorizer`` and ``ring_link`` here, which send the task by name. The
database holds the work itself: a lost ring costs latency, never mail (the
periodic sweep finds the work). Tests replace ``current_app`` to record rings.

**Before every task** of a worker (``task_prerun``, connected here, for the
tracking and insight tasks too) a database connection that broke is dropped.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from celery import current_app, shared_task
from celery.signals import task_prerun
from django.db import (
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)
from django.db.models import QuerySet

from delivery.qmgr.config import qmgr_settings
from delivery.qmgr.sweep import reclaim as reclaim_now
from delivery.qmgr.sweep import sweep as sweep_now
from delivery.route.routing import Route, RouteError, Router, configured_router
from delivery.smtp.deliver import deliver_link as deliver_link_now
from queues import transitions
from queues.bounce import dsn
from queues.bounce.notify import notify
from queues.config import store_settings
from queues.database import drop_connection, is_outage, prepared_cursor, waits_for_database
from queues.lib import clock, first_categorization
from queues.models import (
    Attempt,
    AttemptOutcome,
    AttemptPhase,
    DeliveryType,
    Link,
    Message,
    Queue,
    Recipient,
    RecipientState,
)
from queues.placement import park_poison, special_queue
from queues.signals import PLACED_FACTS, link_work, recipients_placed, recipients_rerouting
from queues.transitions import Claim, while_connected

log = logging.getLogger(__name__)


CATEGORIZE = "delivery.tasks.categorize"
DELIVER_LINK = "delivery.tasks.deliver_link"

# A categorize task hands over to a fresh task after this long, so one
# backlog cannot pin a worker process forever.
CATEGORIZE_SLICE_SECONDS = 30


@task_prerun.connect
def _drop_broken_connections(**kwargs: object) -> None:
    # Connections persist across tasks (CELERY_DB_REUSE_MAX); one that broke
    # (database restarted) is closed here so the task opens a fresh one.
    close_old_connections()


def ring_categorizer(sender: object = None, **kwargs: object) -> None:
    """Receiver of ``categorizer_work``: a categorize task."""
    try:
        current_app.send_task(CATEGORIZE)
    except Exception:  # noqa: BLE001 - the sweep will find the work
        log.warning(
            "could not ring the categorizer; the sweep will pick the work up", exc_info=True
        )


def ring_link(
    sender: object = None, *, link_id: int, countdown: float | None = None, **kwargs: object
) -> None:
    """Receiver of ``link_work``: a deliver_link task for ``link_id``. With
    ``countdown`` (seconds), a task that starts then; that one raises when the
    broker cannot take it (the sender says what the sweep will do instead)."""
    if countdown is not None:
        current_app.send_task(DELIVER_LINK, (link_id,), countdown=countdown)
        return
    try:
        current_app.send_task(DELIVER_LINK, (link_id,))
    except Exception:  # noqa: BLE001 - the sweep will find the work
        log.warning(
            "could not ring link %s; the sweep will pick the work up", link_id, exc_info=True
        )


@shared_task(name=CATEGORIZE)
def categorize() -> int | None:
    # One owner across the reruns an outage costs, as deliver_link below: a
    # rerun first finishes the batch an earlier run claimed (its reply lost).
    # The first run's owner is new: it holds nothing to look for.
    owner = transitions.new_owner()
    runs = itertools.count()

    def categorize_run() -> int:
        return _categorize(owner, held_first=next(runs) > 0)

    return waits_for_database(categorize_run)()


def _categorize(owner: str, *, held_first: bool) -> int:
    started = time.monotonic()
    total = 0
    config = qmgr_settings()
    gather, full = config.categorizer_batch_wait, config.categorizer_batch
    while True:
        taken = categorize_pending(owner, limit=full, held_first=held_first)
        held_first = False
        total += taken
        if not taken:
            return total
        if time.monotonic() - started > CATEGORIZE_SLICE_SECONDS:
            ring_categorizer()
            return total
        if taken < full and gather > 0:
            # The batch took all that was waiting and more is arriving: let the
            # next one gather it (a batch costs the same statements for 3
            # messages or 300). A full batch goes on at once.
            _batch_wait(gather)


_batch_wait = time.sleep  # MAILRELAY_CATEGORIZER_BATCH_WAIT between batches (tests watch it)


@shared_task(name=DELIVER_LINK)
def deliver_link(link_id: int) -> int | None:
    # One owner for the task, across the reruns an outage costs: the link's
    # lease an earlier run took (its reply lost with the connection) is still
    # its own, not a stranger's to wait out.
    return waits_for_database(deliver_link_now)(link_id, transitions.new_owner())


# The periodic tasks do not wait for the database: their next run comes anyway.
@shared_task(name="delivery.tasks.sweep")
@waits_for_database(wait=0)
def sweep() -> dict:
    report = sweep_now()
    return {"links_rung": len(report.links_rung), "purged": report.purged}


@shared_task(name="delivery.tasks.reclaim")
@waits_for_database(wait=0)
def reclaim() -> dict:
    """Take back the claims of dead owners and ring for their work (queues.transitions)."""
    report = reclaim_now()
    return {"recipients": report.recipients_reclaimed, "messages": report.messages_reclaimed}


# --- the categorizer ---------------------------------------------------------------


@dataclass
class _Placement:
    """What the categorizer decided for the recipients of one domain."""

    route: Route | None = None
    error: RouteError | None = None
    recipient_ids: list[int] = field(default_factory=list)


def claim_batch(owner: str, limit: int) -> list[int]:
    """Take up to ``limit`` due Submission messages (one, when it needs isolating)."""
    return [mid for mid, _ in claim_counted(owner, limit)]


def claim_counted(owner: str, limit: int) -> list[tuple[int, int]]:
    """``claim_batch`` with each message's crash count (the poison check)."""
    return Message.objects.claim_for_categorizer(owner, limit, clock.now(), store_settings().lease)


def _route_all(
    domains: set[str], router: Router, claim: Claim | None = None
) -> dict[str, _Placement]:
    placements: dict[str, _Placement] = {}
    for domain in domains:
        # The batch renews its claim while it routes (DNS can be slow): slowness
        # must not look like a crash to the reclaim and the poison guard.
        if claim is not None:
            claim.renew_if_due()
        try:
            placements[domain] = _Placement(route=router.route(domain))
        except RouteError as exc:
            placements[domain] = _Placement(error=exc)
    return placements


def _unroutable(
    domain: str,
    placement: _Placement,
    rows: QuerySet[Recipient],
    now: datetime,
    special: Callable[[str], Queue],
) -> tuple[list[int], list[Attempt]]:
    """A domain with no route: its recipients failed (to the dead letters) or parked
    in Unreachable until the categorizer's retry; returns the failed recipients'
    ids and one ROUTE attempt per recipient."""
    error = placement.error
    assert error is not None
    pairs = list(rows.values_list("id", "message_id"))
    failed_ids: list[int] = []
    if error.permanent:
        failed_ids = [rid for rid, _ in pairs]
        rows.fail(
            now,
            enhanced=error.enhanced,
            text=error.text,
            queue_id=special(DeliveryType.DEAD_LETTER).pk,
            attempted=True,
        )
    else:
        rows.park_unreachable(
            special(DeliveryType.UNREACHABLE).pk,
            now,
            now + qmgr_settings().categorizer_retry_interval,
            enhanced=error.enhanced,
            text=error.text,
        )
    attempts = [
        Attempt(
            recipient_id=rid,
            message_id=mid,
            started_at=now,
            host=domain,
            phase=AttemptPhase.ROUTE,
            code=None,
            enhanced=error.enhanced,
            # No peer replied: no reply code; the enhanced code is its own field.
            text=error.text,
            outcome=AttemptOutcome.FAILED if error.permanent else AttemptOutcome.DEFERRED,
        )
        for rid, mid in pairs
    ]
    return failed_ids, attempts


# --- placement: the delivery queue of a route and its next hop's link -----------------


def queue_for_route(
    delivery_type: str, queue_name: str, link_name: str, hosts: list[dict], now: datetime
) -> Queue:
    """The delivery queue for a destination, attached to the link of its next hop
    (created on first use).

    A destination whose next hop changed (new MX set, new transport) moves to
    the new link; the link's host list follows the latest routing answer.
    """
    link, created = Link.objects.get_or_create(
        name=link_name,
        defaults={"delivery_type": delivery_type, "hosts": hosts, "created_at": now},
    )
    if not created and link.hosts != hosts:
        Link.objects.filter(pk=link.pk).update(hosts=hosts)
    queue, created = Queue.objects.get_or_create(
        delivery_type=delivery_type,
        name=queue_name,
        defaults={"link": link, "created_at": now},
    )
    if not created and queue.reroute_to:
        # Re-routed by an operator (queues.services.reroute): the queue stays on
        # its override link; the route's link is where it returns at the end.
        if queue.reroute_from_id != link.pk:
            Queue.objects.filter(pk=queue.pk).learn_route(link.pk)
    elif not created and queue.link_id != link.pk:
        # Only while the queue is still not re-routed: a re-route committed since
        # we read the row keeps its override link (and learns the new route).
        if Queue.objects.filter(pk=queue.pk, reroute_to="").update(link=link):
            queue.link = link
        else:
            Queue.objects.filter(pk=queue.pk).learn_route(link.pk)
            queue.refresh_from_db(fields=["link", "reroute_to", "reroute_from"])
    return queue


class RouteQueue(NamedTuple):
    """What the categorizer needs of a destination's queue."""

    queue_id: int
    link_id: int | None
    suspended: bool
    route_link_id: int  # the route's link (link_id is an operator's re-route's, if any)


# Both rows of a route as they stand, in one SELECT (the usual case: nothing to
# create or change).
_PG_ROUTE = (
    "SELECT q.id, q.link_id, q.suspended, q.reroute_to, q.reroute_from_id, l.id, l.hosts "
    "FROM queues_link AS l, queues_queue AS q "
    "WHERE l.name = %s AND q.delivery_type = %s AND q.name = %s"
)


def placement_for_route(
    delivery_type: str, queue_name: str, link_name: str, hosts: list[dict], now: datetime
) -> RouteQueue:
    """``queue_for_route`` for the categorizer's hot path: on PostgreSQL one
    SELECT when the queue and its link exist and nothing needs changing, else
    ``queue_for_route`` itself."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute(_PG_ROUTE, [link_name, delivery_type, queue_name])
            row = cur.fetchone()
        if row is not None:
            qid, queue_link, suspended, reroute_to, reroute_from, link_id, stored = row
            if isinstance(stored, str):
                stored = json.loads(stored)
            settled = reroute_from == link_id if reroute_to else queue_link == link_id
            if stored == hosts and settled:
                return RouteQueue(qid, queue_link, suspended, link_id)
    queue = queue_for_route(delivery_type, queue_name, link_name, hosts, now)
    route_link = queue.reroute_from_id if queue.reroute_to else queue.link_id
    return RouteQueue(queue.pk, queue.link_id, queue.suspended, route_link)


def _apply(
    placements: dict[str, _Placement],
    message_ids: list[int],
    facts: dict[int, tuple] | None = None,
) -> set[int]:
    """Write the decisions (the messages, ours, are already queued: Message.
    objects.queue_owned); return the ids of links that received work. ``facts``:
    what the tracking rows need of each recipient (queues.signals.PLACED_FACTS)."""
    now = clock.now()
    specials: dict[str, Queue] = {}

    def special(delivery_type: str) -> Queue:
        if delivery_type not in specials:
            specials[delivery_type] = special_queue(delivery_type, now)
        return specials[delivery_type]

    links: set[int] = set()
    failed: list[Attempt] = []
    failed_ids: list[int] = []
    routed: list[tuple[int, int, int]] = []  # (recipient, queue, link): one statement
    for domain, placement in placements.items():
        if not placement.recipient_ids:
            continue
        # SUBMITTED only: an expiry or an operator may have finished a row meanwhile.
        rows = Recipient.objects.filter(
            id__any=placement.recipient_ids, state=RecipientState.SUBMITTED
        )
        if placement.route is not None:
            route = placement.route
            queue = placement_for_route(
                route.delivery_type,
                route.queue_name,
                route.link_name,
                [hop.as_json() for hop in route.hosts],
                now,
            )
            routed.extend(
                (rid, queue.queue_id, queue.route_link_id) for rid in placement.recipient_ids
            )
            if not queue.suspended and queue.link_id:
                links.add(queue.link_id)
            continue
        failed_now, attempts = _unroutable(domain, placement, rows, now, special)
        failed_ids.extend(failed_now)
        failed.extend(attempts)
    again = _routed_before([rid for rid, _, _ in routed], facts)
    if again:  # their previous routing is their row until this replaces it
        recipients_rerouting.send(None, recipient_ids=again)
    placed = Recipient.objects.place_many(routed, now)
    # Tracking's events of the batch (webhooks, event-log lines; the routings
    # and arrivals are the store's rows), in this transaction.
    recipients_placed.send(None, placements=placements, now=now, facts=facts, placed=placed)
    if failed:
        Attempt.objects.bulk_create(failed)
        _notify_failures(failed_ids, now)
    # A recipient sent back to Submission while we worked (sweep, operator)
    # must not be stranded: its message goes back to Submission too.
    Message.objects.resubmit_if_recipients_submitted(message_ids, now)
    if failed:
        # Only a message with a routing failure here can have become finished:
        # routed recipients wait in a queue (no query per batch otherwise).
        Message.objects.filter(id__any={a.message_id for a in failed}).finish(now)
    return links


_RECEIVED_AT = PLACED_FACTS.index("message__received_at")
_DUE_AT = PLACED_FACTS.index("message__next_attempt_at")


def _routed_before(recipient_ids: list[int], facts: dict[int, tuple] | None) -> list[int]:
    """Those of ``recipient_ids`` that may have a routing already: all but the
    recipients of messages on their first categorization."""
    if facts is None:
        return recipient_ids
    return [
        rid
        for rid in recipient_ids
        if rid not in facts
        or not first_categorization(facts[rid][_RECEIVED_AT], facts[rid][_DUE_AT])
    ]


def _notify_failures(recipient_ids: list[int], now) -> None:
    """NDRs for recipients that cannot be routed at all (null MX, NXDOMAIN)."""
    if not recipient_ids:
        return
    by_message: dict[int, list[Recipient]] = defaultdict(list)
    for r in Recipient.objects.filter(id__in=recipient_ids):
        by_message[r.message_id].append(r)
    originals = Message.objects.filter(id__in=list(by_message)).exclude(mail_from="")
    # Without bodies: notify reads the one original it quotes, when it quotes it.
    for message in originals.defer("data").iterator():
        notify(dsn.FAILURE, message, by_message[message.pk], now=now)


def categorize_pending(
    owner: str | None = None, limit: int | None = None, *, held_first: bool = False
) -> int:
    """Route one batch of submitted messages. Returns how many messages it took.

    ``held_first``: the batch is what ``owner`` claimed already and still
    holds, if anything (a task run again after an outage: the claim may have
    committed with its reply lost).

    Steps:
    1. claim a batch of due Submission messages (row locks, SKIP LOCKED); a message
       from a batch that crashed is claimed alone, with the try counted in
       crash_count; one past the poison threshold goes to Poison;
    2. load their recipients that await routing;
    3. route each distinct domain once (transport map, smart host, DNS);
    4. in one transaction: place recipients in their delivery queue, fail the
       permanently unroutable, park the temporarily unroutable in Unreachable,
       mark the messages queued (or done) and clear the crash count;
    5. after commit, ring the links that got work.
    """
    owner = owner or transitions.new_owner()
    limit = limit or qmgr_settings().categorizer_batch
    acquired_at = time.monotonic()  # the claim's lease runs from its request
    lease = store_settings().lease
    claimed = Message.objects.claim_held(owner, clock.now(), lease) if held_first else []
    claimed = claimed or claim_counted(owner, limit)
    if not claimed:
        return 0
    ids = [mid for mid, _ in claimed]
    poisoned = {mid for mid, crashes in claimed if transitions.poisoned(crashes)}
    if poisoned:
        park_poison(sorted(poisoned))
        ids = [i for i in ids if i not in poisoned]
    links: set[int] = set()
    claim = Claim(
        f"categorizer {owner}",
        lambda until: Message.objects.renew(owner, until) > 0,
        acquired_at=acquired_at,
    )
    try:
        # A database restart is waited out while the claim holds (not a crash).
        links = while_connected(claim, lambda: _process(ids, owner, claim))
    except Exception as exc:
        if is_outage(exc):
            raise  # away for a whole lease: the reclaim hands the batch on
        if len(ids) == 1:  # claimed alone: the claim counted this try already
            log.exception("categorizing message %s failed", ids[0])
            _release_after_crash(ids[0], count=False)
        else:
            log.exception("categorizing %d messages failed; retrying one by one", len(ids))
        # One bad message must not take its batch-mates down with it.
        for mid in ids if len(ids) > 1 else []:
            try:
                links |= _process([mid], owner, claim)
            except Exception:
                log.exception("categorizing message %s failed", mid)
                _release_after_crash(mid, count=True)
    # A link whose delivery task is running needs no new task: that task looks
    # for due work again after it lets go of the link (delivery.deliver_link).
    for link_id in sorted(links - _busy(links)):
        link_work.send(sender=None, link_id=link_id)
    return len(ids) + len(poisoned)


def _busy(links: set[int]) -> set[int]:
    """Those of ``links`` whose delivery task runs (it looks for due work again
    after it lets go); none when the database went away after the batch
    committed: a ring too many costs a task that finds its link held."""
    if not links:
        return set()
    try:
        held = Link.objects.filter(id__any=links, lease_until__gt=clock.now())
        return set(held.values_list("id", flat=True))
    except (OperationalError, InterfaceError) as exc:
        if not is_outage(exc):
            raise
        drop_connection()
        return set()


def _process(ids: list[int], owner: str, claim: Claim | None = None) -> set[int]:
    recipients = _to_route(ids)
    placements = _route_all({r[0] for r in recipients}, configured_router(), claim)
    with transaction.atomic():
        # Only messages still ours: had the claim expired, another categorizer
        # owns them now and will place them itself. Ours become queued here, in
        # the transaction that places their recipients (one UPDATE of each).
        mine = set(Message.objects.queue_owned(ids, owner))
        if not mine:
            return set()
        facts: dict[int, tuple] = {}
        for domain, *fact in recipients:
            rid, mid = fact[0], fact[2]
            if mid in mine:
                placements[domain].recipient_ids.append(rid)
                facts[rid] = tuple(fact)
        return _apply(placements, sorted(mine), facts)


def _to_route(ids: list[int]) -> list[tuple]:
    """The submitted recipients of ``ids`` to route, with what their tracking rows
    need (domain, then queues.signals.PLACED_FACTS), by id; on PostgreSQL one
    statement, its plan pinned (migration queues/0014)."""
    if connection.vendor == "postgresql":
        with prepared_cursor() as cur:
            cur.execute("SELECT * FROM queues_to_route(%s::bigint[])", [list(ids)])
            return [(*row[:7], _inet(row[7]), *row[8:]) for row in cur.fetchall()]
    return list(
        Recipient.objects.filter(message_id__in=ids, state=RecipientState.SUBMITTED)
        .order_by("id")
        .values_list("domain", *PLACED_FACTS)
    )


def _inet(value: object) -> str | None:
    """client_address as the ORM gives it (a string; psycopg loads inet as an address)."""
    return None if value is None else str(value)


def _release_after_crash(message_id: int, *, count: bool) -> None:
    """Give a message that raised back to Submission, to be tried alone; ``count``
    adds the crash to its count (a claim of one counted it already)."""
    retry_at = clock.now() + qmgr_settings().categorizer_retry_interval
    Message.objects.filter(id=message_id).crashed(retry_at, count=count)
