"""Read-only representations of the queue store for the REST API.

Message content (full headers, Message-ID, body preview) is included only
when the view says the caller may read it (``context["content"]``).
"""

from __future__ import annotations

from datetime import datetime

from rest_framework import serializers

from queues.filters import message_body_preview, message_headers, message_status, queue_status
from queues.holdings import next_attempts
from queues.lib import clock
from queues.models import Attempt, AuditEntry, Event, Link, Message, Queue, Recipient

MAX_ATTEMPTS_SHOWN = 500


class LinkBriefSerializer(serializers.ModelSerializer):
    class Meta:
        model = Link
        fields = ["id", "name", "state", "next_retry_at"]


class QueueBriefSerializer(serializers.ModelSerializer):
    class Meta:
        model = Queue
        fields = ["id", "name", "delivery_type"]


class LinkSerializer(serializers.ModelSerializer):
    leased = serializers.SerializerMethodField()

    class Meta:
        model = Link
        fields = [
            "id",
            "name",
            "delivery_type",
            "hosts",
            "state",
            "next_retry_at",
            "failure_count",
            "first_failure_at",
            "last_error",
            "last_error_at",
            "last_success_at",
            "leased",
            "created_at",
        ]

    def get_leased(self, link: Link) -> bool:
        return bool(link.lease_until and link.lease_until > clock.now())


class QueueSerializer(serializers.ModelSerializer):
    link = LinkBriefSerializer(read_only=True)
    status = serializers.SerializerMethodField()
    next_retry_at = serializers.SerializerMethodField()
    oldest_age_seconds = serializers.SerializerMethodField()
    last_error = serializers.SerializerMethodField()
    effective_limits = serializers.SerializerMethodField()
    next_attempt_at = serializers.SerializerMethodField()
    count_age_seconds = serializers.SerializerMethodField()

    class Meta:
        model = Queue
        fields = [
            "id",
            "name",
            "delivery_type",
            "link",
            "effective_limits",
            "status",
            "suspended",
            "suspended_until",
            "suspended_by",
            "reroute_to",
            "reroute_until",
            "reroute_by",
            "message_count",
            "counted_at",
            "incoming_rate",
            "outgoing_rate",
            "oldest_received_at",
            "oldest_age_seconds",
            "last_error",
            "last_error_at",
            "next_retry_at",
            "next_attempt_at",
            "count_age_seconds",
            "last_delivery_at",
            "created_at",
        ]

    def get_status(self, queue: Queue) -> str:
        return queue_status(queue)

    def get_next_attempt_at(self, queue: Queue) -> datetime | None:
        """The earliest next attempt over what it holds, not before the link's retry
        (queues.holdings.next_attempts; the view passes them for its page)."""
        known = self.context.get("next_attempts")
        if known is None or queue.pk not in known:
            known = next_attempts([queue])
        return known.get(queue.pk)

    def get_count_age_seconds(self, queue: Queue) -> int | None:
        """How old message_count is: 0 when counted for this answer (exact), else
        seconds since the sweep's recount (queues.services.counts.current_counts)."""
        counts = self.context.get("counts")
        if counts is None:
            return None
        return counts.age_seconds(clock.now())

    def get_effective_limits(self, queue: Queue) -> str:
        """Traffic shaping now (docs/shaping.md): "" without MAILRELAY_SHAPING."""
        from delivery.shaping.gate import effective_limits

        return effective_limits(queue.link if queue.link_id else None)

    def get_next_retry_at(self, queue: Queue) -> datetime | None:
        return queue.link.next_retry_at if queue.link_id and queue.link else None

    def get_oldest_age_seconds(self, queue: Queue) -> int | None:
        if queue.oldest_received_at is None:
            return None
        return max(int((clock.now() - queue.oldest_received_at).total_seconds()), 0)

    def get_last_error(self, queue: Queue) -> str:
        # A link in Retry failed to connect: that is the queue's problem too.
        link = queue.link if queue.link_id else None
        if link is not None and link.state == "retry" and link.last_error:
            return link.last_error
        return queue.last_error


class RecipientSerializer(serializers.ModelSerializer):
    queue = QueueBriefSerializer(read_only=True)

    class Meta:
        model = Recipient
        fields = [
            "id",
            "address",
            "domain",
            "orcpt",
            "notify",
            "state",
            "queue",
            "next_attempt_at",
            "attempt_count",
            "first_failure_at",
            "last_attempt_at",
            "last_code",
            "last_enhanced",
            "last_text",
            "last_host",
            "delay_dsn_sent",
            "final_at",
        ]


class AttemptSerializer(serializers.ModelSerializer):
    class Meta:
        model = Attempt
        fields = [
            "id",
            "recipient_id",
            "queue_id",
            "started_at",
            "duration_ms",
            "host",
            "ip",
            "port",
            "phase",
            "code",
            "enhanced",
            "text",
            "outcome",
            # What the message page shows of the session (docs/api.md).
            "tls_version",
            "tls_cipher",
            "tls_verified",
            "tls_policy",
            "auth_used",
        ]


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = Event
        fields = ["id", "created_at", "level", "kind", "text", "queue_id", "data"]


def _last_error(recipients: list[Recipient]) -> str:
    failing = [r for r in recipients if r.last_text and r.state != "delivered"]
    if not failing:
        return ""
    latest = max(failing, key=lambda r: (r.last_attempt_at is not None, r.last_attempt_at, r.id))
    parts = [str(latest.last_code or ""), latest.last_enhanced, latest.last_text]
    return " ".join(p for p in parts if p)


class MessageListSerializer(serializers.ModelSerializer):
    """One row of the messages list; recipients come from ``instance._recipients``."""

    status = serializers.SerializerMethodField()
    sender = serializers.CharField(source="mail_from")
    recipients = serializers.SerializerMethodField()
    recipient_count = serializers.SerializerMethodField()
    queues = serializers.SerializerMethodField()
    last_error = serializers.SerializerMethodField()
    attempt_count = serializers.SerializerMethodField()
    message_id = serializers.SerializerMethodField()

    class Meta:
        model = Message
        fields = [
            "id",
            "qid",
            "status",
            "state",
            "suspended",
            "suspended_until",
            "sender",
            "recipients",
            "recipient_count",
            "subject",
            "message_id",
            "size",
            "queues",
            "source",
            "received_at",
            "expires_at",
            "last_error",
            "attempt_count",
        ]

    def _rcpts(self, message: Message) -> list[Recipient]:
        rcpts = getattr(message, "_recipients", None)
        if rcpts is None:
            rcpts = list(message.recipients.select_related("queue").order_by("id"))
            message._recipients = rcpts
        return rcpts

    def get_status(self, message: Message) -> str:
        return message_status(message, [r.state for r in self._rcpts(message)])

    def get_recipients(self, message: Message) -> list[str]:
        return [r.address for r in self._rcpts(message)[:20]]

    def get_recipient_count(self, message: Message) -> int:
        return len(self._rcpts(message))

    def get_queues(self, message: Message) -> list[dict]:
        seen: dict[int, dict] = {}
        for r in self._rcpts(message):
            if r.queue_id and r.queue_id not in seen:
                seen[r.queue_id] = {"id": r.queue_id, "name": r.queue.name}
        return list(seen.values())

    def get_last_error(self, message: Message) -> str:
        return _last_error(self._rcpts(message))

    def get_attempt_count(self, message: Message) -> int:
        return sum(r.attempt_count for r in self._rcpts(message))

    def get_message_id(self, message: Message) -> str | None:
        return message.message_id if self.context.get("content") else None


class MessageDetailSerializer(MessageListSerializer):
    envelope = serializers.SerializerMethodField()
    recipients = serializers.SerializerMethodField()
    attempts = serializers.SerializerMethodField()
    attempts_truncated = serializers.SerializerMethodField()
    events = serializers.SerializerMethodField()
    headers = serializers.SerializerMethodField()
    preview = serializers.SerializerMethodField()

    class Meta(MessageListSerializer.Meta):
        fields = [
            *MessageListSerializer.Meta.fields,
            "envelope",
            "per_message_failures",
            "problem",
            "crash_count",
            "next_attempt_at",
            "completed_at",
            "attempts",
            "attempts_truncated",
            "events",
            "headers",
            "preview",
        ]

    def get_envelope(self, message: Message) -> dict:
        return {
            "mail_from": message.mail_from,
            "rcpt_to": [
                {"address": r.address, "orcpt": r.orcpt, "notify": r.notify}
                for r in self._rcpts(message)
            ],
            "body": message.body_type,
            "smtputf8": message.smtputf8,
            "ret": message.ret,
            "envid": message.envid,
            "size": message.declared_size,
            "client_address": message.client_address,
            "client_helo": message.client_helo,
            "auth_account": message.auth_account,  # the SMTP account that submitted it
            "dkim_signed": message.signed,
        }

    def get_recipients(self, message: Message) -> list[dict]:
        return RecipientSerializer(self._rcpts(message), many=True).data

    def _attempts(self, message: Message) -> list[Attempt]:
        rows = getattr(message, "_attempts", None)
        if rows is None:
            rows = list(
                Attempt.objects.filter(message=message).order_by("-started_at", "-id")[
                    : MAX_ATTEMPTS_SHOWN + 1
                ]
            )
            message._attempts = rows
        return rows

    def get_attempts(self, message: Message) -> list[dict]:
        rows = self._attempts(message)[:MAX_ATTEMPTS_SHOWN]
        return AttemptSerializer(list(reversed(rows)), many=True).data

    def get_attempts_truncated(self, message: Message) -> bool:
        return len(self._attempts(message)) > MAX_ATTEMPTS_SHOWN

    def get_events(self, message: Message) -> list[dict]:
        rows = Event.objects.filter(message=message).order_by("created_at", "id")[:200]
        return EventSerializer(rows, many=True).data

    def get_headers(self, message: Message) -> list[list[str]] | None:
        if not self.context.get("content"):
            return None
        return [[name, value] for name, value in message_headers(message)]

    def get_preview(self, message: Message) -> dict | None:
        if not self.context.get("content"):
            return None
        text, truncated = message_body_preview(message)
        return {"text": text, "truncated": truncated}


class AuditEntrySerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor_name")

    class Meta:
        model = AuditEntry
        fields = [
            "id",
            "created_at",
            "actor",
            "via",
            "action",
            "target_type",
            "target_ids",
            "filter",
            "count",
            "detail",
        ]


class BulkSerializer(serializers.Serializer):
    """A bulk action: on ``ids``, or on a ``filter`` (the list's query parameters)."""

    action = serializers.CharField()
    ids = serializers.ListField(
        child=serializers.IntegerField(min_value=1), required=False, max_length=10000
    )
    filter = serializers.DictField(required=False)
    confirm = serializers.BooleanField(default=False)
    ndr = serializers.BooleanField(default=False)
    # Only say what it would do (ids or filter), change nothing.
    dry_run = serializers.BooleanField(default=False)
    until = serializers.CharField(required=False, allow_blank=True, max_length=100)
    to = serializers.CharField(required=False, allow_blank=True, max_length=300)
    # Single-message options: named here so a bulk request with them is a clear 400.
    recipient = serializers.CharField(required=False, allow_blank=True, max_length=1100)
    sender = serializers.CharField(required=False, allow_blank=True, max_length=600)

    def validate(self, attrs):
        if ("ids" in attrs) == ("filter" in attrs):
            raise serializers.ValidationError("give either ids or filter")
        return attrs


class RemoveSerializer(serializers.Serializer):
    ndr = serializers.BooleanField(default=False)


class ActionOptionsSerializer(serializers.Serializer):
    """The options of one action on one row (queues.spec.OPTION_HELP); an option
    the action does not take is a 400."""

    until = serializers.CharField(required=False, allow_blank=True, max_length=100)
    to = serializers.CharField(required=False, allow_blank=True, max_length=300)
    recipient = serializers.CharField(required=False, allow_blank=True, max_length=1100)
    sender = serializers.CharField(required=False, allow_blank=True, max_length=600)


class PreviewSerializer(serializers.Serializer):
    """What a bulk action would do (queues.services.actions.Preview)."""

    matched = serializers.IntegerField()
    skipped = serializers.IntegerField()
    in_flight = serializers.IntegerField()
    recipients = serializers.IntegerField()
    failing = serializers.IntegerField()
    ndrs = serializers.IntegerField()
    ndr_senders = serializers.IntegerField()
    messages = serializers.IntegerField()
    # The first messages it would touch, oldest first: id, qid, sender,
    # recipients (the first three; more_recipients), queues, age_seconds.
    sample = serializers.ListField(child=serializers.DictField())


class ExportSerializer(serializers.Serializer):
    ids = serializers.ListField(
        child=serializers.IntegerField(min_value=1), required=False, max_length=10000
    )
    filter = serializers.DictField(required=False)

    def validate(self, attrs):
        if ("ids" in attrs) == ("filter" in attrs):
            raise serializers.ValidationError("give either ids or filter")
        return attrs


class BulkResultSerializer(serializers.Serializer):
    action = serializers.CharField()
    count = serializers.IntegerField()
    confirmed = serializers.BooleanField()
    detail = serializers.CharField()
    preview = PreviewSerializer(required=False)
