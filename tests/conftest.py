"""Shared fixtures. Tests run against real PostgreSQL and Redis (see README)."""

import pytest
from django.db.backends.postgresql.operations import DatabaseOperations

from queues.lib import clock

_truncate_flush = DatabaseOperations.sql_flush


def _delete_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
    """How the test database is emptied after each transactional test.

    Django flushes with one ``TRUNCATE`` of every table, which gives each of
    the ~45 tables and their indexes new files: about 0.35 s a test here,
    against 0.03 s for a ``DELETE`` of the few rows a test leaves. Every
    foreign key is deferrable (Django's), so the order does not matter in
    Django's flush transaction. Only this test process's flush is changed,
    never the relay's.
    """
    if reset_sequences or allow_cascade or not tables:
        return _truncate_flush(
            self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )
    return ["SET CONSTRAINTS ALL DEFERRED;"] + [
        f"DELETE FROM {self.quote_name(table)};" for table in tables
    ]


DatabaseOperations.sql_flush = _delete_flush

pytest_plugins = [
    "tests.support.dns",
    "tests.support.sinks",
    "tests.support.ingress",
    "tests.support.processes",
]


@pytest.fixture(autouse=True)
def _reset_clock():
    clock.reset()
    yield
    clock.reset()


class BellRecorder:
    """Stands in for Celery's ``send_task`` under the doorbells
    (``delivery.qmgr.tasks``) in tests that drive the engine in-process: the
    bells run, and what they would send is recorded."""

    def __init__(self) -> None:
        self.categorizer = 0
        self.links: list[int] = []
        self.later: list[tuple[int, float]] = []  # countdown rings: (link id, seconds)

    def send_task(self, name: str, args: tuple = (), countdown: float | None = None, **kw) -> None:
        from delivery.qmgr import tasks

        if name == tasks.CATEGORIZE:
            self.categorizer += 1
        elif name == tasks.DELIVER_LINK and countdown is not None:
            self.later.append((args[0], countdown))
        elif name == tasks.DELIVER_LINK:
            self.links.append(args[0])
        else:
            raise AssertionError(f"no doorbell sends {name}")


@pytest.fixture(autouse=True)
def bells(request, monkeypatch):
    """No Celery task leaves an in-process test; system tests keep the real bells."""
    if request.node.get_closest_marker("system"):
        yield None
        return
    from delivery.qmgr import tasks

    recorder = BellRecorder()
    monkeypatch.setattr(tasks, "current_app", recorder)
    yield recorder


@pytest.fixture
def webhook_endpoint():
    """Make an enabled webhook endpoint wanting ``events`` (its URL never
    called); the process's endpoint cache read again before and after."""
    from queues.lib import clock
    from tracking import record
    from tracking.models import WebhookEndpoint

    def make(*events: str) -> WebhookEndpoint:
        record.invalidate()
        return WebhookEndpoint.objects.create(
            name="-".join(events),
            url="https://hooks.example.org/in",
            events=list(events),
            secret="s" * 32,
            created_at=clock.now(),
            updated_at=clock.now(),
        )

    yield make

    record.invalidate()
