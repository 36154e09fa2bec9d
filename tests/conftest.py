"""Shared fixtures. Tests run against real PostgreSQL and Redis (see README)."""

import pytest

from queues.lib import clock

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
