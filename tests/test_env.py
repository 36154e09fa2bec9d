from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured

from mailrelay.env import env_duration, env_int, env_networks, env_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", timedelta(seconds=90)),
        ("15m", timedelta(minutes=15)),
        ("2h", timedelta(hours=2)),
        ("2d", timedelta(days=2)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1w", timedelta(days=7)),
        ("00:01:00", timedelta(minutes=1)),
        ("2.00:00:00", timedelta(days=2)),
        ("1.02:03:04", timedelta(days=1, hours=2, minutes=3, seconds=4)),
    ],
)
def test_it_parses_durations(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "2x", "h", "1h 30m", "1.25:61:00", "-5m", "5"])
def test_it_refuses_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_it_names_the_setting_of_a_bad_value(monkeypatch):
    monkeypatch.setenv("MAILRELAY_X", "soon")
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_X"):
        env_duration("MAILRELAY_X", "1m")
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_X"):
        env_int("MAILRELAY_X", 1)
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_X"):
        env_size("MAILRELAY_X", "1M")
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_X"):
        env_networks("MAILRELAY_X", "")


def test_it_parses_sizes_in_binary_units():
    assert parse_size("35MB") == 35 * 1024 * 1024
    assert parse_size("512K") == 512 * 1024
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("35 parsecs")


def test_it_reads_a_secret_from_a_file(monkeypatch, tmp_path):
    secret = tmp_path / "n"
    secret.write_text("42\n")
    monkeypatch.setenv("MAILRELAY_N_FILE", str(secret))
    assert env_int("MAILRELAY_N", 1) == 42
