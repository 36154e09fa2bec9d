"""The queue store: the single source of truth for every message.

A message is accepted into the Submission queue, categorized into one
delivery queue per destination domain (recipients of one message may wait
in several queues), and delivered over the queue's link (its next hop).
Every state change lives here; Celery only says "there is work".
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q

# The states live in queues.states (the transitions use them too); re-exported
# here because every caller knows them as queues.models.*.
from queues.states import (  # noqa: F401
    FINAL_RECIPIENT_STATES,
    WAITING_RECIPIENT_STATES,
    AttemptOutcome,
    AttemptPhase,
    DeliveryType,
    EventLevel,
    LinkState,
    MessageSource,
    MessageState,
    RecipientState,
)
from queues.transitions import (
    LinkQuerySet,
    MessageQuerySet,
    QueueQuerySet,
    RecipientQuerySet,
)
from queues.transitions.flow import RetryHintQuerySet


class Link(models.Model):
    """One next hop (a smart host, a transport destination, an MX host set).

    Connections are opened per link, so the per-destination connection limit
    and the connection-failure retry state live here.
    """

    name = models.CharField(max_length=1024, unique=True)
    delivery_type = models.CharField(max_length=20, choices=DeliveryType.choices)
    # [{"host": "mx1.example.com", "port": 25, "preference": 10, "literal": false}, ...]
    hosts = models.JSONField(default=list)
    state = models.CharField(max_length=10, choices=LinkState.choices, default=LinkState.READY)
    next_retry_at = models.DateTimeField(null=True, blank=True)
    failure_count = models.PositiveIntegerField(default=0)
    # start of the current run of connection failures (auto-resubmit, expiry)
    first_failure_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    last_error_at = models.DateTimeField(null=True, blank=True)
    last_success_at = models.DateTimeField(null=True, blank=True)
    # The TLS of the last session (e.g. "TLSv1.3 verified (mta-sts)"; "" before any).
    last_tls = models.CharField(max_length=120, blank=True)
    # A delivery task owns the link while it delivers (one owner at a time).
    lease_owner = models.CharField(max_length=100, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()

    objects = LinkQuerySet.as_manager()

    def __str__(self) -> str:
        return self.name


class Queue(models.Model):
    """Messages waiting for one destination (next-hop domain and delivery type)."""

    name = models.CharField(max_length=255)
    delivery_type = models.CharField(max_length=20, choices=DeliveryType.choices)
    link = models.ForeignKey(
        Link, null=True, blank=True, on_delete=models.SET_NULL, related_name="queues"
    )
    suspended = models.BooleanField(default=False)
    # A timed suspension resumes by itself at suspended_until (delivery.qmgr.sweep);
    # None = until resumed by hand. suspended_by: the operator who suspended it.
    suspended_until = models.DateTimeField(null=True, blank=True)
    suspended_by = models.CharField(max_length=150, blank=True)
    # Re-route: while reroute_to is set (a next hop like "[10.0.0.9]:25" or
    # "smarthost.example.net"), the queue is delivered there instead of its
    # own link, until reroute_until (None = until unrouted by hand).
    reroute_to = models.CharField(max_length=300, blank=True)
    reroute_until = models.DateTimeField(null=True, blank=True)
    reroute_by = models.CharField(max_length=150, blank=True)
    # The link the queue had before the re-route: given back at its end.
    reroute_from = models.ForeignKey(
        Link, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    last_error = models.TextField(blank=True)
    last_error_at = models.DateTimeField(null=True, blank=True)
    last_delivery_at = models.DateTimeField(null=True, blank=True)
    # Shown by the Queue Viewer; maintained by the engine, never counted per page view.
    message_count = models.PositiveIntegerField(default=0)
    counted_at = models.DateTimeField(null=True, blank=True)
    # Also refreshed by queues_recount (queues.services.counts), with message_count.
    incoming_rate = models.FloatField(default=0)  # messages per minute arriving
    outgoing_rate = models.FloatField(default=0)  # messages per minute leaving (delivered/failed)
    oldest_received_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()

    objects = QueueQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["delivery_type", "name"], name="queue_unique_name")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.delivery_type})"


class Message(models.Model):
    qid = models.CharField("queue id", max_length=20, unique=True)
    state = models.CharField(
        max_length=12, choices=MessageState.choices, default=MessageState.SUBMISSION
    )
    source = models.CharField(max_length=8, choices=MessageSource.choices)
    # Envelope, exactly as given ("" is the null sender <>).
    mail_from = models.CharField(max_length=512, blank=True)
    body_type = models.CharField(max_length=12, blank=True)  # 7BIT / 8BITMIME / ""
    smtputf8 = models.BooleanField(default=False)
    ret = models.CharField(max_length=4, blank=True)  # FULL / HDRS / ""
    envid = models.CharField(max_length=200, blank=True)
    declared_size = models.BigIntegerField(null=True, blank=True)
    client_address = models.GenericIPAddressField(null=True, blank=True)
    client_helo = models.CharField(max_length=255, blank=True)
    # The exact received bytes, preceded by our Received header (and a
    # Message-ID header when the message had none).
    data = models.BinaryField()
    size = models.BigIntegerField()
    message_id = models.CharField(max_length=998, blank=True)
    subject = models.CharField(max_length=998, blank=True)
    received_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    next_attempt_at = models.DateTimeField()  # when the categorizer may take it
    suspended = models.BooleanField(default=False)
    # Resumes by itself then (delivery.qmgr.sweep); None = until resumed by hand.
    suspended_until = models.DateTimeField(null=True, blank=True)
    suspended_by = models.CharField(max_length=150, blank=True)
    per_message_failures = models.PositiveIntegerField(default=0)
    problem = models.BooleanField(default=False)
    crash_count = models.PositiveIntegerField(default=0)
    # In a batch whose categorizer died, or crashed one: claimed alone from now on,
    # so the poison guard counts only its own crashes (queues.transitions).
    isolate = models.BooleanField(default=False)
    lease_owner = models.CharField(max_length=100, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    # The SMTP account that submitted it with AUTH ("" when none).
    auth_account = models.CharField(max_length=150, blank=True)
    # Header fields added when the message is sent (a DKIM-Signature), before
    # the stored bytes: what leaves is ``signature + data``; ``data`` stays
    # exactly what was received.
    signature = models.BinaryField(default=b"", blank=True)
    # Its arrival is its own tracking event (tracking.history): the ``received``
    # event's stable id (its webhook's and event-log line's id too). NULL: a
    # message stored before migration 0016, whose ``received`` row is written
    # in tracking_event.
    event_id = models.UUIDField(null=True, blank=True, default=uuid.uuid4)

    objects = MessageQuerySet.as_manager()

    class Meta:
        indexes = [
            # categorizer claim: state=submission, due, oldest first
            models.Index(
                fields=["next_attempt_at", "id"],
                name="message_submission_due",
                condition=Q(state="submission"),
            ),
            # categorizer claim of a message to be tried alone (isolate): found
            # without scanning the whole due backlog
            models.Index(
                fields=["next_attempt_at", "id"],
                name="message_isolated_due",
                condition=Q(state="submission", isolate=True),
            ),
            # sweep/reclaim: timed suspensions that are due to end (queues.services.timed)
            models.Index(
                fields=["suspended_until"],
                name="message_suspended_until",
                condition=Q(suspended_until__isnull=False),
            ),
            # sweep: expired categorizer claims
            models.Index(
                fields=["lease_until"],
                name="message_categorizing_lease",
                condition=Q(state="categorizing"),
            ),
            # purge of completed messages
            models.Index(fields=["completed_at"], name="message_done", condition=Q(state="done")),
            # sweep: messages past their expiry that are not finished (delivery.qmgr.sweep._expire)
            models.Index(
                fields=["expires_at"], name="message_live_expiry", condition=~Q(state="done")
            ),
            # Queue Viewer message list: ORDER BY received_at DESC, id DESC with a keyset
            # (received_at, id) < (cursor); the age filters (older/newer than)
            models.Index(fields=["received_at", "id"], name="message_received"),
            # Queue Viewer message list sorted by size, and the min/max size filters
            models.Index(fields=["size", "id"], name="message_size"),
            # Queue Viewer message list filtered by the submitting SMTP account
            models.Index(
                fields=["auth_account", "id"],
                name="message_by_account",
                condition=~Q(auth_account=""),
            ),
            # Substring filters on mail_from, subject and message_id search MessageText.
        ]

    def __str__(self) -> str:
        return self.qid

    @property
    def signed(self) -> bool:
        """Whether a DKIM-Signature goes out with it (queues.dkim)."""
        return bool(self.signature)


# The references the hot path writes (a recipient's message and queue, an
# attempt's recipient, message and queue) have no constraint in the database:
# its check cost a lookup and a row lock at every commit (migration 0013). The
# store's transitions write them; deletes go through the ORM, which cascades.
class Recipient(models.Model):
    message = models.ForeignKey(
        Message, on_delete=models.CASCADE, related_name="recipients", db_constraint=False
    )
    address = models.CharField(max_length=512)
    domain = models.CharField(max_length=255)  # lower-cased, IDNA as given
    orcpt = models.CharField(max_length=600, blank=True)  # "rfc822;user@example.com"
    notify = models.CharField(max_length=40, blank=True)  # "SUCCESS,FAILURE,DELAY" / "NEVER"
    queue = models.ForeignKey(
        Queue,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="recipients",
        db_constraint=False,
    )
    state = models.CharField(
        max_length=10, choices=RecipientState.choices, default=RecipientState.SUBMITTED
    )
    next_attempt_at = models.DateTimeField()
    # The delivery round that holds the recipient while ACTIVE (its results are
    # written only while it still does), and until when without renewal.
    lease_owner = models.CharField(max_length=100, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    attempt_count = models.PositiveIntegerField(default=0)
    first_failure_at = models.DateTimeField(null=True, blank=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_enhanced = models.CharField(max_length=16, blank=True)
    last_text = models.TextField(blank=True)
    last_host = models.CharField(max_length=300, blank=True)
    delay_dsn_sent = models.BooleanField(default=False)
    final_at = models.DateTimeField(null=True, blank=True)
    # Its last routing, which is its ``routed`` tracking event (issue #24;
    # tracking.history): when the categorizer placed it, in which queue, by
    # which link (the route's, not an operator's re-route). Kept while it moves
    # on (delivered, failed, parked); a new routing replaces them, the previous
    # one moved into tracking_event first (queues.signals.recipients_rerouting).
    # NULL: never routed, or routed before migration queues/0017.
    routed_at = models.DateTimeField(null=True, blank=True)
    routed_queue = models.ForeignKey(
        Queue,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,  # queues and links are never deleted
        related_name="+",
        db_constraint=False,
        db_index=False,
    )
    routed_link = models.ForeignKey(
        Link,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        related_name="+",
        db_constraint=False,
        db_index=False,
    )

    objects = RecipientQuerySet.as_manager()

    class Meta:
        indexes = [
            # delivery claim: due recipients of a queue, oldest message first
            models.Index(
                fields=["queue", "next_attempt_at", "message"],
                name="recipient_waiting",
                condition=Q(state__in=["queued", "deferred"]),
            ),
            # sweep: expired delivery claims
            models.Index(
                fields=["lease_until"], name="recipient_active_lease", condition=Q(state="active")
            ),
            # sweep: due unreachable recipients; categorizer: submitted recipients
            models.Index(
                fields=["message"], name="recipient_submitted", condition=Q(state="submitted")
            ),
            # Queue Viewer message list filtered by recipient domain:
            # WHERE EXISTS (SELECT 1 FROM recipient WHERE domain = %s AND message_id = m.id)
            models.Index(fields=["domain", "message"], name="recipient_domain"),
            # tracking search: the routings of recipients in the store, newest first
            models.Index(
                fields=["-routed_at", "-id"],
                name="recipient_routed",
                condition=Q(routed_at__isnull=False),
            ),
            # Substring filters on address and last_text use pg_trgm GIN indexes created
            # by migration 0003 on PostgreSQL only (not in model state).
        ]

    def __str__(self) -> str:
        return self.address


class MessageText(models.Model):
    """What the Queue Viewer's substring filters on the sender, the Subject and
    the Message-ID search: one row a message, written by the database itself.

    A message's row changes state three times on its way (claimed, queued,
    done), and no such change is a HOT update (the state is in partial indexes'
    predicates), so PostgreSQL writes an entry into every index of the row at
    each: with the pg_trgm GIN indexes on the row, every trigram of the three
    texts again, half of what a state change costs (bench/README.md, session
    19). Here the text is indexed once. Triggers (migration 0012) write the row
    when a message is inserted, correct it when an operator corrects the
    sender, and delete it with its message: no code writes it, and nothing but
    the filters (``queues.filters``) reads it, so it is an index the database
    keeps, not a second truth.
    """

    message = models.OneToOneField(
        Message,
        on_delete=models.DO_NOTHING,  # deleted with its message by the database's trigger
        primary_key=True,
        related_name="search_text",
        db_constraint=False,  # no foreign-key check on the accept's path
    )
    mail_from = models.CharField(max_length=512, blank=True)
    subject = models.CharField(max_length=998, blank=True)
    msgid = models.CharField(max_length=998, blank=True)  # the Message-ID header


class Attempt(models.Model):
    """One try to deliver one recipient: where, when, and what the peer said."""

    recipient = models.ForeignKey(
        Recipient, on_delete=models.CASCADE, related_name="attempts", db_constraint=False
    )
    # Indexed by attempt_by_message (message, started_at), which leads with it.
    message = models.ForeignKey(
        Message,
        on_delete=models.CASCADE,
        related_name="attempts",
        db_index=False,
        db_constraint=False,
    )
    queue = models.ForeignKey(
        Queue, null=True, on_delete=models.SET_NULL, related_name="+", db_constraint=False
    )
    started_at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField(default=0)
    host = models.CharField(max_length=300, blank=True)
    ip = models.CharField(max_length=64, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    phase = models.CharField(max_length=10, choices=AttemptPhase.choices)
    code = models.PositiveSmallIntegerField(null=True, blank=True)
    enhanced = models.CharField(max_length=16, blank=True)
    text = models.TextField(blank=True)
    outcome = models.CharField(max_length=10, choices=AttemptOutcome.choices)
    # The session's TLS ("" in cleartext), how the peer was verified, under
    # which policy level, and the AUTH mechanism used with the next hop.
    tls_version = models.CharField(max_length=16, blank=True)
    tls_cipher = models.CharField(max_length=100, blank=True)
    tls_verified = models.CharField(max_length=20, blank=True)  # none/ca/dane/mta-sts
    tls_policy = models.CharField(max_length=20, blank=True)  # none/may/encrypt/verify/...
    auth_used = models.CharField(max_length=20, blank=True)  # PLAIN/LOGIN
    # A delivery is its own tracking event (tracking.history): the event's
    # stable id (its webhook's and event-log line's id too) and the next hop's
    # queue id read from its reply. NULL event_id: an attempt that is not an
    # event of its own (not delivered, or written before migration 0015 beside
    # its tracking row).
    event_id = models.UUIDField(null=True, blank=True)
    remote_id = models.CharField(max_length=100, blank=True)
    # The link the round delivered on (the event's next hop; a queue's link
    # may change later, by a re-route).
    link = models.ForeignKey(
        Link,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        related_name="+",
        db_index=False,
        db_constraint=False,
    )

    class Meta:
        indexes = [
            models.Index(fields=["message", "started_at"], name="attempt_by_message"),
            # The tracking search of the deliveries of messages still in the
            # store (tracking.history): newest first, and by remote queue id.
            models.Index(
                fields=["-started_at", "id"],  # the search's order (tracking.history)
                name="attempt_delivered",
                condition=Q(outcome="delivered"),
            ),
            models.Index(
                fields=["remote_id"],
                name="attempt_remote_id",
                condition=Q(outcome="delivered") & ~Q(remote_id=""),
            ),
        ]


class Event(models.Model):
    """What the system did: level changes, crashes, routing decisions."""

    created_at = models.DateTimeField()
    level = models.CharField(max_length=8, choices=EventLevel.choices, default=EventLevel.INFO)
    kind = models.CharField(max_length=40)
    text = models.TextField()
    message = models.ForeignKey(
        Message, null=True, blank=True, on_delete=models.CASCADE, related_name="events"
    )
    queue = models.ForeignKey(
        Queue, null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        indexes = [models.Index(fields=["created_at"], name="event_by_time")]


class RetryHint(models.Model):
    """Exim's retry data: per host/IP for host errors, per address+sender for RCPT 4xx."""

    key = models.CharField(max_length=700, unique=True)
    first_failed = models.DateTimeField()
    last_tried = models.DateTimeField()
    next_try = models.DateTimeField()
    expired = models.BooleanField(default=False)
    error = models.CharField(max_length=40, blank=True)
    text = models.TextField(blank=True)

    objects = RetryHintQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["last_tried"], name="retryhint_by_last_tried")]


class QueueSample(models.Model):
    """One queue's depth and traffic at one recount (queues_recount), for the
    Queue Viewer's last-hour chart. ``queue`` is None for the all-queues total.
    Rows older than two hours are pruned by the recount that writes new ones.
    """

    sampled_at = models.DateTimeField()
    queue = models.ForeignKey(
        Queue,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="samples",
        db_index=False,  # queuesample_by_queue leads with queue
    )
    seconds = models.FloatField()  # length of the interval this sample covers
    depth = models.PositiveIntegerField()  # messages waiting at sampled_at
    incoming = models.PositiveIntegerField(default=0)  # messages that arrived in the interval
    delivered = models.PositiveIntegerField(default=0)  # recipients delivered in the interval
    failed = models.PositiveIntegerField(default=0)  # recipients failed in the interval
    # The highest Attempt id counted so far: the next recount counts the ones after it.
    attempt_mark = models.BigIntegerField(default=0)
    # The highest Message id seen so far (arrivals of the total row).
    message_mark = models.BigIntegerField(default=0)

    class Meta:
        indexes = [
            # chart of one queue: WHERE queue_id = %s AND sampled_at >= now - 1h ORDER BY sampled_at
            models.Index(fields=["queue", "sampled_at"], name="queuesample_by_queue"),
            # pruning (sampled_at < now - 2h) and the previous-sample lookup
            models.Index(fields=["sampled_at"], name="queuesample_by_time"),
        ]


class AuditEntry(models.Model):
    """What an operator did: who, what, on which filter or ids, how many, when."""

    created_at = models.DateTimeField()
    actor = models.ForeignKey(
        "auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150)  # kept when the user is deleted
    via = models.CharField(max_length=10)  # ui / api / cli
    action = models.CharField(max_length=40)  # e.g. queue_suspend, message_remove
    target_type = models.CharField(max_length=20)  # queue / message / link
    target_ids = models.JSONField(default=list, blank=True)
    filter = models.JSONField(default=dict, blank=True)
    count = models.PositiveIntegerField(default=0)
    detail = models.TextField(blank=True)

    class Meta:
        indexes = [models.Index(fields=["created_at"], name="audit_by_time")]


class SmtpAccount(models.Model):
    """A client that may relay with SMTP AUTH (submission): mailrelay's own accounts."""

    username = models.CharField(max_length=150, unique=True)
    password = models.CharField(max_length=128)  # Django's hasher format, never shown
    enabled = models.BooleanField(default=True)
    # Sender addresses ("user@example.com") and domains ("example.com") it may use.
    allowed_senders = models.JSONField(default=list, blank=True)
    max_messages_per_hour = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField()
    last_login_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return self.username


class MtaStsPolicy(models.Model):
    """A domain's MTA-STS policy (RFC 8461), cached for its max_age."""

    domain = models.CharField(max_length=255, unique=True)
    policy_id = models.CharField(max_length=64)
    mode = models.CharField(max_length=10)  # enforce / testing / none
    mx = models.JSONField(default=list)  # the policy's mx patterns
    max_age = models.PositiveIntegerField()
    text = models.TextField(blank=True)  # the policy as fetched
    fetched_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.domain} ({self.mode})"


class DkimKey(models.Model):
    """A DKIM signing key kept in the database (keys may also come from files)."""

    domain = models.CharField(max_length=255)
    selector = models.CharField(max_length=63)
    algorithm = models.CharField(max_length=20)  # rsa-sha256 / ed25519-sha256
    private_key = models.TextField()  # PEM (RSA) or base64 seed (Ed25519), never shown
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["domain", "selector"], name="dkimkey_unique")
        ]

    def __str__(self) -> str:
        return f"{self.selector}._domainkey.{self.domain}"
