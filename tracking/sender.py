"""The webhook sender: claim due outbox rows, POST each, record the attempt.

Runs in the ``webhooks`` Celery queue (its own worker with a few threads), so
a slow or dead endpoint never holds a categorize or delivery task. Rows are
claimed with ``FOR UPDATE SKIP LOCKED`` and a lease: a sender that dies
leaves its rows to the next one once the lease ran out (at least once).

Back-off is per endpoint: after a failed POST the endpoint rests 30 s,
doubling with each failure in a row up to 1 h, and none of its webhooks is
tried meanwhile (a dead endpoint costs one try per interval, not one per
event); its first success ends it. A webhook whose next try would come later
than ``MAILRELAY_WEBHOOK_RETRY_FOR`` (24 h) after its event is ``failed``
(shown on the endpoint's page and in the API); so is, by ``fail_expired``
(beat), any pending row older than that which no sender holds (a disabled
endpoint's rows, which are not claimed, wait for it until then).

``MAILRELAY_WEBHOOK_TIMEOUT`` bounds each POST as a whole (a watchdog shuts a
socket still busy at the deadline), and a claim's lease outlasts POSTing all
its rows, so a slow receiver never leads another sender to take them too.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import queue
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.db import transaction
from django.db.models import Case, F, Q, TextField, Value, When

from queues.database import retry_outages
from queues.lib import clock
from queues.transitions import new_owner
from tracking import signing
from tracking.config import tracking_settings
from tracking.endpoints import EndpointError, is_public, normalize_url, resolve
from tracking.models import DeliveryState, WebhookAttempt, WebhookDelivery, WebhookEndpoint

log = logging.getLogger(__name__)

CLAIM = 20
LEASE = timedelta(minutes=5)
FIRST_RETRY = 30.0
MAX_RETRY = 3600.0
DISABLED_WAIT = timedelta(minutes=5)
READ_LIMIT = 64 * 1024
USER_AGENT = "mailrelay-webhooks/1"


@dataclass
class PostResult:
    status: int | None
    error: str
    duration_ms: int

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def owner_id() -> str:
    return new_owner()  # the store's one owner token


def backoff(attempts: int) -> timedelta:
    """Wait after the ``attempts``-th failed try: 30 s, 1 m, 2 m … 1 h."""
    return timedelta(seconds=min(FIRST_RETRY * 2 ** max(attempts - 1, 0), MAX_RETRY))


class _Connection(http.client.HTTPConnection):
    """One POST's connection: to addresses resolved (and checked) beforehand, each
    connect bounded by what is left of the POST's deadline; ``abort`` (the
    watchdog at the deadline) shuts the socket, ending any read in progress."""

    def __init__(
        self,
        host: str,
        port: int,
        addresses: list[str],
        deadline: float,
        context: ssl.SSLContext | None,
    ) -> None:
        super().__init__(host, port, timeout=max(deadline - time.monotonic(), 0.001))
        self.addresses, self.deadline, self.context = addresses, deadline, context
        self.aborted = False

    def connect(self) -> None:
        error: OSError = OSError(f"no address for {self.host}")
        for address in self.addresses:
            left = self.deadline - time.monotonic()
            if left <= 0 or self.aborted:
                raise TimeoutError("timed out")
            try:
                sock = socket.create_connection((address, self.port), left)
            except OSError as exc:
                error = exc
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
            self.sock = sock
            return
        raise error

    def abort(self) -> None:
        self.aborted = True
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def post(
    url: str, body: str, headers: dict[str, str], timeout: float, allow_private: bool = True
) -> PostResult:
    """One POST, no redirects followed; any 2xx is success.

    ``timeout`` bounds the whole request (connect, send, the answer and up to
    ``READ_LIMIT`` of its body), not each socket read: a receiver that trickles
    its answer a byte at a time is cut at the deadline. Without
    ``allow_private``, a host that resolves to a loopback, private or
    link-local address is refused (the addresses connected to are those checked).
    """
    started = time.monotonic()
    deadline = started + timeout
    try:  # a URL saved before it was checked on save (tracking.endpoints.normalize_url)
        parts = urlsplit(normalize_url(url))
    except EndpointError as exc:
        return PostResult(None, f"unusable URL: {exc}"[:500], 0)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    conn: _Connection | None = None
    try:
        addresses = resolve(parts.hostname, port)
        if not allow_private:
            public = [a for a in addresses if is_public(a)]
            if not public:
                return PostResult(
                    None,
                    f"refused: {parts.hostname} resolves to a private address "
                    f"({', '.join(addresses)}); MAILRELAY_WEBHOOK_ALLOW_PRIVATE is false",
                    int((time.monotonic() - started) * 1000),
                )
            addresses = public
        context = None
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=tracking_settings().tls_ca_file or None)
        conn = _Connection(parts.hostname, port, addresses, deadline, context)
        watchdog = threading.Timer(max(deadline - time.monotonic(), 0), conn.abort)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("POST", path, body=body.encode(), headers=headers)
            response = conn.getresponse()
            response.read(READ_LIMIT)
            status = response.status
        finally:
            watchdog.cancel()
            conn.close()
    except (OSError, http.client.HTTPException, ValueError) as exc:  # ValueError: UnicodeError
        if conn is not None and conn.aborted:
            text = f"TimeoutError: timed out (no whole answer within {timeout:g} s)"
        else:
            text = f"{type(exc).__name__}: {exc}"[:500]
        return PostResult(None, text, int((time.monotonic() - started) * 1000))
    ms = int((time.monotonic() - started) * 1000)
    return PostResult(status, "" if 200 <= status < 300 else f"HTTP {status}", ms)


def headers_for(delivery: WebhookDelivery, secret: str, timestamp: int) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        signing.EVENT_ID_HEADER: str(delivery.event_id),
        signing.EVENT_TYPE_HEADER: delivery.event,
        signing.SIGNATURE_HEADER: signing.header(secret, timestamp, delivery.body),
    }


def _due(now: datetime):
    """Pending rows due now, not leased, of an enabled endpoint that is not resting.

    A disabled endpoint's rows are not claimed: they wait for it to be enabled
    again, and are failed once older than MAILRELAY_WEBHOOK_RETRY_FOR
    (``fail_expired``)."""
    return (
        WebhookDelivery.objects.filter(
            state=DeliveryState.PENDING, next_attempt_at__lte=now, endpoint__enabled=True
        )
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
        .filter(Q(endpoint__down_until__isnull=True) | Q(endpoint__down_until__lte=now))
    )


def lease_for(limit: int, timeout: float) -> timedelta:
    """A claim's lease: longer than POSTing every row of it up to its timeout."""
    return max(LEASE, timedelta(seconds=2 * limit * timeout + 60))


def claim(
    owner: str,
    now: datetime,
    limit: int = CLAIM,
    lease: timedelta = LEASE,
    *,
    held: bool = False,
) -> list[WebhookDelivery]:
    """Lease up to ``limit`` due rows to ``owner``. With ``held`` (a sender's run
    after a database outage), first the pending rows ``owner`` still holds: a
    claim whose COMMIT went through while its reply was lost, which would
    otherwise wait out their lease (at least 5 minutes) before anyone sent them."""
    with transaction.atomic():
        ids: list[int] = []
        if held:
            ids = list(
                WebhookDelivery.objects.filter(
                    state=DeliveryState.PENDING, lease_owner=owner, lease_until__gt=now
                )
                .select_for_update(of=("self",))
                .order_by("next_attempt_at", "id")
                .values_list("id", flat=True)[:limit]
            )
        if len(ids) < limit:
            ids += list(
                _due(now)
                .select_for_update(skip_locked=True, of=("self",))
                .order_by("next_attempt_at", "id")
                .values_list("id", flat=True)[: limit - len(ids)]
            )
        if not ids:
            return []
        WebhookDelivery.objects.filter(id__in=ids).update(
            lease_owner=owner, lease_until=now + lease
        )
    return list(
        WebhookDelivery.objects.filter(id__in=ids, lease_owner=owner)
        .select_related("endpoint")
        .order_by("next_attempt_at", "id")
    )


GAVE_UP = "not sent within MAILRELAY_WEBHOOK_RETRY_FOR"


def fail_expired(now: datetime) -> int:
    """Fail every pending row older than MAILRELAY_WEBHOOK_RETRY_FOR that no sender
    holds: one UPDATE (rows of a resting, dead or disabled endpoint are not tried,
    so nothing else would fail them)."""
    cutoff = now - tracking_settings().webhook_retry_for
    return (
        WebhookDelivery.objects.filter(state=DeliveryState.PENDING, created_at__lt=cutoff)
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
        .update(
            state=DeliveryState.FAILED,
            finished_at=now,
            lease_owner="",
            lease_until=None,
            last_error=Case(
                When(last_error="", then=Value(GAVE_UP)),
                default=F("last_error"),
                output_field=TextField(),
            ),
        )
    )


def _finish(delivery: WebhookDelivery, owner: str, **changes) -> None:
    WebhookDelivery.objects.filter(pk=delivery.pk, lease_owner=owner).update(
        lease_owner="", lease_until=None, **changes
    )


def _endpoint_up(endpoint: WebhookEndpoint, at: datetime) -> None:
    if endpoint.failures or endpoint.down_until:
        log.info("webhook endpoint %s answers again", endpoint.name)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        failures=0, down_until=None, last_error="", last_success_at=at
    )


def _endpoint_down(endpoint: WebhookEndpoint, at: datetime, error: str) -> datetime:
    """One more failure of ``endpoint``: it rests for its back-off; returns until
    when. Its row is locked for the count (another sender may fail it too)."""
    failures = (
        WebhookEndpoint.objects.select_for_update()
        .filter(pk=endpoint.pk)
        .values_list("failures", flat=True)
        .first()
        or 0
    ) + 1
    until = at + backoff(failures)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        failures=failures, down_until=until, last_error=error
    )
    return until


# Endpoints POSTed to at once by one claim: a slow receiver holds its own rows,
# never another endpoint's (each endpoint's rows go in order, one at a time).
ENDPOINTS_AT_ONCE = 8


@dataclass
class _Sent:
    """What became of one claimed row in its endpoint's thread (no database there)."""

    delivery: WebhookDelivery
    result: PostResult | None  # None: not tried
    wait_until: datetime | None = None  # untried: until when (None: its endpoint rests)


def _post_endpoint(
    rows: list[WebhookDelivery],
    now: datetime,
    timeout: float,
    allow_private: bool,
    last_start: float,
    out: queue.SimpleQueue,
) -> None:
    """POST one endpoint's rows in order; after its first failure the rest wait
    (with the endpoint, for its back-off). Each outcome goes to ``out`` at once."""
    failed = False
    for delivery in rows:
        endpoint = delivery.endpoint
        if failed:
            out.put(_Sent(delivery, None))
        elif not endpoint.enabled:  # disabled since the claim: waits for it, untried
            out.put(_Sent(delivery, None, now + DISABLED_WAIT))
        elif time.monotonic() > last_start:  # the lease runs out: the next claim
            out.put(_Sent(delivery, None, delivery.next_attempt_at))
        else:
            try:
                result = post(
                    endpoint.url,
                    delivery.body,
                    headers_for(delivery, endpoint.secret, int(time.time())),
                    timeout,
                    allow_private,
                )
            except Exception as exc:  # noqa: BLE001 - recorded on this delivery; the others go on
                log.exception("webhook %s to %s", delivery.event_id, endpoint.name)
                result = PostResult(None, f"{type(exc).__name__}: {exc}"[:500], 0)
            failed = not result.ok
            out.put(_Sent(delivery, result))


def _record(sent: _Sent, owner: str, resting: dict[int, datetime], until: float) -> None:
    """Write what became of one row, in one transaction; while the database is
    away, try again until the monotonic time ``until`` (the claim's lease less
    a margin). A try whose COMMIT went through but whose reply was lost finds
    the row no longer held and writes nothing more: one attempt per POST,
    one failure per failed POST on its endpoint."""

    def once() -> None:
        with transaction.atomic():
            _record_once(sent, owner, resting)

    retry_outages(once, lambda: time.monotonic() < until)


def _record_once(sent: _Sent, owner: str, resting: dict[int, datetime]) -> None:
    """Its attempt, its new state, its endpoint's, if ``owner`` still holds the row
    (not when another sender took it over after the lease, nor twice)."""
    delivery, result = sent.delivery, sent.result
    still_held = (
        WebhookDelivery.objects.select_for_update()
        .filter(pk=delivery.pk, lease_owner=owner, state=DeliveryState.PENDING)
        .exists()
    )
    if not still_held:
        log.info("webhook %s: no longer held by this sender; not recorded", delivery.event_id)
        return
    endpoint = delivery.endpoint
    deadline = delivery.created_at + tracking_settings().webhook_retry_for
    if result is None:  # waits (with its endpoint), untried
        wait_until = sent.wait_until or resting.get(endpoint.pk) or delivery.next_attempt_at
        if wait_until > deadline:
            _finish(
                delivery,
                owner,
                state=DeliveryState.FAILED,
                finished_at=clock.now(),
                last_error=delivery.last_error or GAVE_UP,
            )
        else:
            _finish(delivery, owner, next_attempt_at=wait_until)
        return
    at = clock.now()
    WebhookAttempt.objects.create(
        delivery=delivery,
        endpoint=endpoint,
        at=at,
        status=result.status,
        error=result.error,
        duration_ms=result.duration_ms,
    )
    attempts = delivery.attempts + 1
    tried = {"attempts": attempts, "last_status": result.status, "last_error": result.error}
    if result.ok:
        _endpoint_up(endpoint, at)
        _finish(delivery, owner, state=DeliveryState.DELIVERED, finished_at=at, **tried)
        return
    resting[endpoint.pk] = next_at = _endpoint_down(endpoint, at, result.error)
    if next_at > deadline:
        _finish(delivery, owner, state=DeliveryState.FAILED, finished_at=at, **tried)
        log.warning(
            "webhook %s to %s failed for good: %s", delivery.event_id, endpoint.name, result.error
        )
        return
    _finish(delivery, owner, next_attempt_at=next_at, **tried)


def send_due(owner: str | None = None, limit: int = CLAIM, *, held: bool = False) -> int:
    """Send one claim of due webhooks. Returns how many rows it claimed.

    Each endpoint's rows are POSTed by a thread of their own (up to
    ``ENDPOINTS_AT_ONCE`` endpoints at once), which touches no database; this
    thread writes each outcome as it comes. One row's error (a URL that
    cannot be sent to, a bug) is recorded on that row and never stops another's.
    ``held``: first take the rows ``owner`` still holds (see ``claim``).
    """
    owner = owner or owner_id()
    now = clock.now()
    config = tracking_settings()
    timeout, allow_private = config.webhook_timeout, config.webhook_allow_private
    lease = lease_for(limit, timeout)
    claimed_at = time.monotonic()
    batch = claim(owner, now, limit, lease, held=held)
    if not batch:
        return 0
    # No POST starts that could end after the lease (another sender may take the rows then),
    # and no record is tried again after it.
    last_start = claimed_at + lease.total_seconds() - timeout - 30
    record_until = claimed_at + lease.total_seconds() - 30
    by_endpoint: dict[int, list[WebhookDelivery]] = {}
    for delivery in batch:
        by_endpoint.setdefault(delivery.endpoint_id, []).append(delivery)
    out: queue.SimpleQueue[_Sent] = queue.SimpleQueue()
    resting: dict[int, datetime] = {}  # endpoints that failed in this claim: until when
    workers = min(ENDPOINTS_AT_ONCE, len(by_endpoint))
    with ThreadPoolExecutor(workers, thread_name_prefix="webhook-post") as pool:
        futures = [
            pool.submit(_post_endpoint, rows, now, timeout, allow_private, last_start, out)
            for rows in by_endpoint.values()
        ]
        left = len(batch)
        while left:
            try:
                sent = out.get(timeout=0.5)
            except queue.Empty:
                if all(f.done() for f in futures) and out.empty():
                    break  # a thread died: its rows wait for their lease to end
                continue
            left -= 1
            try:
                _record(sent, owner, resting, record_until)
            except Exception:  # noqa: BLE001 - the row is retried when its lease ends
                log.exception("could not record webhook %s", sent.delivery.event_id)
    return len(batch)


def has_due(now: datetime | None = None) -> bool:
    return _due(now or clock.now()).exists()


KEEP_FINISHED = timedelta(days=7)
PRUNE_BATCH = 5000
PRUNE_SECONDS = 60


def prune(now: datetime) -> int:
    """Delivered and failed rows (with their attempts) are kept a week; deleted in
    batches until none is left or ``PRUNE_SECONDS`` passed (the next run goes on)."""
    total = 0
    started = time.monotonic()
    while time.monotonic() - started < PRUNE_SECONDS:
        ids = list(
            WebhookDelivery.objects.filter(finished_at__lt=now - KEEP_FINISHED).values_list(
                "id", flat=True
            )[:PRUNE_BATCH]
        )
        if ids:
            WebhookDelivery.objects.filter(id__in=ids).delete()
        total += len(ids)
        if len(ids) < PRUNE_BATCH:
            break
    return total
