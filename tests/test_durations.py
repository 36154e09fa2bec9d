"""The one duration formatter: Exim's exact notation, the viewer's and the CLI's roundings."""

from __future__ import annotations

from datetime import timedelta

import pytest

from queues.lib import format_duration, parse_duration

S = timedelta(seconds=1)
M = timedelta(minutes=1)
H = timedelta(hours=1)
D = timedelta(days=1)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (timedelta(0), "0s"),
        (S / 2, "0.5s"),
        (45 * S, "45s"),
        (D + 8 * H + 15 * M, "1d8h15m"),
        (7 * H + 35 * M + 37.5 * S, "7h35m37.5s"),
        (D + 5 * S, "1d5s"),
        (9 * D, "9d"),  # no weeks
        (-15 * M, "-15m"),
    ],
)
def test_exact_is_exims_notation_and_reads_back(value, text):
    assert format_duration(value) == text
    if value >= timedelta(0):
        assert parse_duration(text) == value


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (timedelta(0), "0 s"),
        (45 * S + S / 2, "45 s"),
        (12 * M + 5 * S, "12 min"),  # seconds only under a minute
        (3 * H + 5 * M + 59 * S, "3 h 5 min"),
        (3 * H + 59 * S, "3 h"),
        (2 * D + 4 * H + 30 * M, "2 d 4 h"),
        (D + 5 * M, "1 d"),  # two units from the largest: 0 h, so the minutes go too
    ],
)
def test_the_viewer_shows_two_units_rounded_down(value, text):
    assert format_duration(value, units=2, spaced=True) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(timedelta(0), "0s"), (59 * S, "59s"), (12 * M + 5 * S, "12m"), (25 * H, "1d")],
)
def test_one_unit_for_a_column(value, text):
    assert format_duration(value, units=1) == text
