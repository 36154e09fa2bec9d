from django.apps import AppConfig


class TrackingConfig(AppConfig):
    name = "tracking"
    verbose_name = "Message tracking and webhooks"

    def ready(self) -> None:
        # A message's life is recorded from the signals of the queue store, sent
        # by the engine and the store in the transaction of what they describe
        # (neither imports anything of this app).
        from django.db.models.signals import post_save

        from queues import signals, transitions
        from queues.bounce.notify import dsn_sent
        from queues.models import AuditEntry
        from tracking import history, record

        signals.recipients_rerouting.connect(
            history.on_rerouting, dispatch_uid="tracking.rerouting"
        )
        signals.recipients_placed.connect(record.on_placed, dispatch_uid="tracking.placed")
        signals.attempts_recorded.connect(
            record.on_attempts_recorded, dispatch_uid="tracking.attempted"
        )
        transitions.hear_deliveries(record.heard)  # a delivery is a row only when heard
        signals.recipients_expired.connect(record.on_expired, dispatch_uid="tracking.expired")
        signals.messages_purging.connect(history.on_purging, dispatch_uid="tracking.purging")
        post_save.connect(record.on_audit, sender=AuditEntry, dispatch_uid="tracking.audit")
        dsn_sent.connect(record.on_dsn_sent, dispatch_uid="tracking.dsn_sent")
