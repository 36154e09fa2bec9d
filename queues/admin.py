"""Django admin: a read-only window onto the queue store, for admins.

The admin changes nothing in the mail models: every change to queues,
links and messages goes through the services (queues.services.actions),
which keep the state machine's rules and write the audit log, so operators
act in the Queue Viewer, the REST API or ``manage.py queue|message``. The
admin stays for looking at raw rows and for managing users, groups and
tokens. It needs the admin role (a superuser, or staff in the ``admin``
group), and its login goes through the login throttle.
"""

from django.contrib import admin

from queues.login import ThrottledAdminAuthenticationForm
from queues.models import Attempt, AuditEntry, Event, Link, Message, Queue, Recipient
from queues.permissions import ADMIN, has_role


def _admin_site_permission(request) -> bool:
    user = request.user
    return bool(user.is_active and user.is_staff and has_role(user, ADMIN))


admin.site.has_permission = _admin_site_permission
admin.site.login_form = ThrottledAdminAuthenticationForm
admin.site.site_header = "mailrelay administration (read-only for mail: act in the Queue Viewer)"


class ReadOnlyAdmin(admin.ModelAdmin):
    """View only: no add, change or delete, no bulk actions."""

    actions = None
    ordering = ("-pk",)  # newest first, and a stable order for the paginator

    def has_module_permission(self, request) -> bool:
        return has_role(request.user, ADMIN)

    def has_view_permission(self, request, obj=None) -> bool:
        return has_role(request.user, ADMIN)

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Link)
class LinkAdmin(ReadOnlyAdmin):
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
class QueueAdmin(ReadOnlyAdmin):
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

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def has_view_permission(self, request, obj=None) -> bool:
        return has_role(request.user, ADMIN)


@admin.register(Message)
class MessageAdmin(ReadOnlyAdmin):
    list_display = ("qid", "state", "mail_from", "subject", "size", "source", "received_at")
    list_filter = ("state", "source", "suspended")
    search_fields = ("qid", "mail_from", "message_id", "subject", "recipients__address")
    exclude = ("data",)
    readonly_fields = [f.name for f in Message._meta.fields if f.name != "data"]
    inlines = [RecipientInline]
    show_full_result_count = False


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = ("started_at", "recipient", "host", "ip", "phase", "code", "enhanced", "outcome")
    list_filter = ("outcome", "phase")
    raw_id_fields = ("recipient", "message", "queue")


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "level", "kind", "text")
    list_filter = ("level", "kind")
    raw_id_fields = ("message", "queue")


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "actor_name", "via", "action", "target_type", "count")
    list_filter = ("action", "via", "target_type")
