"""``queues.lib``: the one duration-to-seconds conversion."""

from __future__ import annotations

from datetime import timedelta

import pytest

from queues.lib import seconds


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (timedelta(minutes=5), 300.0),
        (timedelta(milliseconds=250), 0.25),
        (timedelta(0), 0.0),
        (30, 30.0),
        (2.5, 2.5),
    ],
)
def test_seconds(value, expected):
    got = seconds(value)
    assert got == expected and type(got) is float
