"""The Celery app. Tasks are doorbells: they carry ids, never mail."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mailrelay.settings")

app = Celery("mailrelay")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _schedule_sweep(sender: Celery, **kwargs: object) -> None:
    from django.conf import settings

    sender.add_periodic_task(
        settings.MAILRELAY_SWEEP_INTERVAL.total_seconds(),
        sender.signature("delivery.tasks.sweep"),
        name="sweep due and orphaned work",
    )
