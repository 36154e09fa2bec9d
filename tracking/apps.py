from django.apps import AppConfig


class TrackingConfig(AppConfig):
    name = "tracking"
    verbose_name = "Message tracking and webhooks"

    def ready(self) -> None:
        # Operator actions and DSNs are recorded from the signals of the queue
        # store (queues imports nothing of this app).
        from django.db.models.signals import post_save

        from queues.bounce.notify import dsn_sent
        from queues.models import AuditEntry
        from tracking import hooks

        post_save.connect(hooks.on_audit, sender=AuditEntry, dispatch_uid="tracking.audit")
        dsn_sent.connect(hooks.on_dsn_sent, dispatch_uid="tracking.dsn_sent")
