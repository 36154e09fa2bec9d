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
    """Stands in for the Celery doorbells in tests that drive the engine in-process."""

    def __init__(self) -> None:
        self.categorizer = 0
        self.links: list[int] = []

    def ring_categorizer(self) -> None:
        self.categorizer += 1

    def ring_link(self, link_id: int) -> None:
        self.links.append(link_id)


@pytest.fixture(autouse=True)
def bells(request, monkeypatch):
    """No Celery task leaves an in-process test; system tests keep the real bells."""
    if request.node.get_closest_marker("system"):
        yield None
        return
    from delivery.qmgr import bell

    recorder = BellRecorder()
    monkeypatch.setattr(bell, "ring_categorizer", recorder.ring_categorizer)
    monkeypatch.setattr(bell, "ring_link", recorder.ring_link)
    yield recorder
