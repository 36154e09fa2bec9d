"""Django admin: a plain window onto the queue store until the Queue Viewer lands."""

from django.contrib import admin

from queues.models import Attempt, Event, Link, Message, Queue, Recipient


@admin.register(Link)
class LinkAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "delivery_type",
        "state",
        "next_retry_at",
        "failure_count",
        "last_error",
        "last_success_at",
    )
    list_filter = ("state", "delivery_type")
    search_fields = ("name",)


@admin.register(Queue)
class QueueAdmin(admin.ModelAdmin):
    list_display = ("name", "delivery_type", "link", "suspended", "last_error", "last_delivery_at")
    list_filter = ("delivery_type", "suspended")
    search_fields = ("name",)


class RecipientInline(admin.TabularInline):
    model = Recipient
    extra = 0
    can_delete = False
    fields = (
        "address",
        "state",
        "queue",
        "attempt_count",
        "next_attempt_at",
        "last_code",
        "last_enhanced",
        "last_text",
        "last_host",
    )
    readonly_fields = fields


@admin.register(Message)
class MessageAdmin(admin.ModelAdmin):
    list_display = ("qid", "state", "mail_from", "subject", "size", "source", "received_at")
    list_filter = ("state", "source", "suspended")
    search_fields = ("qid", "mail_from", "message_id", "subject", "recipients__address")
    exclude = ("data",)
    readonly_fields = [f.name for f in Message._meta.fields if f.name != "data"]
    inlines = [RecipientInline]
    show_full_result_count = False


@admin.register(Attempt)
class AttemptAdmin(admin.ModelAdmin):
    list_display = ("started_at", "recipient", "host", "ip", "phase", "code", "enhanced", "outcome")
    list_filter = ("outcome", "phase")
    raw_id_fields = ("recipient", "message", "queue")


@admin.register(Event)
class EventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "level", "kind", "text")
    list_filter = ("level", "kind")
    raw_id_fields = ("message", "queue")
