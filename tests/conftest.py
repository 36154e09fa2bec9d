"""Shared fixtures. Tests run against real PostgreSQL and Redis (see README)."""

import pytest

from queues import clock

pytest_plugins = ["tests.support.dns", "tests.support.sinks", "tests.support.ingress"]


@pytest.fixture(autouse=True)
def _reset_clock():
    clock.reset()
    yield
    clock.reset()
