"""The Celery app. Tasks are doorbells: they carry ids, never mail."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mailrelay.settings")

app = Celery("mailrelay")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # tracking.tasks, insight.tasks
# The engine's one Celery module is its queue manager's (delivery/qmgr/tasks.py);
# the task names stay "delivery.tasks.*" (routes, beat and queued tasks use them).
app.autodiscover_tasks(["delivery.qmgr"])  # and its task_prerun hook


@app.on_after_finalize.connect
def _schedule_sweep(sender: Celery, **kwargs: object) -> None:
    from django.conf import settings

    sender.add_periodic_task(
        settings.MAILRELAY_SWEEP_INTERVAL.total_seconds(),
        sender.signature("delivery.tasks.sweep"),
        name="sweep due and orphaned work",
    )
    # Dead owners' claims are taken back every third of the lease (at most every
    # sweep interval): a killed worker's mail moves on within about a lease.
    sender.add_periodic_task(
        min(
            settings.MAILRELAY_SWEEP_INTERVAL.total_seconds(),
            settings.MAILRELAY_DELIVERY_LEASE.total_seconds() / 3,
        ),
        sender.signature("delivery.tasks.reclaim"),
        name="reclaim the claims of dead owners",
    )
