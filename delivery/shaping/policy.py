"""The shaping policy file (``MAILRELAY_SHAPING``): parse, validate, match.

YAML (``.yaml``/``.yml``) or TOML (``.toml``); the schema is in
docs/shaping.md. A file that cannot be used is refused with its line and the
reason, and the policy read before stays in force (``delivery.shaping.gate.
current``, which reads the file again when it changes).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import yaml

from queues.lib import parse_duration

log = logging.getLogger(__name__)

DEFAULT = "default"
MATCH_KEYS = ("domain", "mx", "next_hop")
LIMIT_KEYS = (
    "max_connections",
    "max_messages_per_connection",
    "max_message_rate",
    "max_connection_rate",
    "connect_timeout",
    "source_address",
    "helo_name",
    "on_throttle",
)
THROTTLE_KEYS = ("factor", "cooldown", "min_factor", "texts")
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d*)\s*([a-z]+)\s*$")
_RATE_UNITS = {
    "s": 1,
    "sec": 1,
    "second": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "h": 3600,
    "hour": 3600,
    "d": 86400,
    "day": 86400,
}
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class PolicyError(ValueError):
    """A policy file that cannot be used: where (line) and why."""

    def __init__(self, line: int | None, reason: str) -> None:
        self.line = line
        self.reason = reason
        super().__init__(f"line {line}: {reason}" if line else reason)


@dataclass(frozen=True)
class Rate:
    """At most ``count`` in any ``period`` seconds (a sliding window)."""

    count: int
    period: float

    def __str__(self) -> str:
        for unit, secs in (("d", 86400), ("h", 3600), ("min", 60)):
            if self.period == secs:
                return f"{self.count}/{unit}"
        return f"{self.count}/{self.period:g}s"

    def scaled(self, factor: float) -> Rate:
        return Rate(max(1, int(self.count * factor)), self.period)


@dataclass(frozen=True)
class Throttle:
    """``on_throttle``: what a throttling reply does to the entry's limits."""

    enabled: bool = True
    factor: float = 0.5  # multiplies the effective factor at each throttling reply
    cooldown: float = 600.0  # seconds before a step back up (each step: one cool-down)
    min_factor: float = 1 / 16
    texts: tuple[str, ...] = ()  # lower-cased; a 4xx reply containing one is a throttle


@dataclass(frozen=True)
class Entry:
    name: str
    domains: tuple[str, ...] = ()
    mx: tuple[str, ...] = ()
    next_hops: tuple[str, ...] = ()
    max_connections: int = 20
    max_messages_per_connection: int = 20
    max_message_rate: Rate | None = None
    max_connection_rate: Rate | None = None
    connect_timeout: float = 30.0
    source_address: tuple[str, ...] = ()
    helo_name: str = ""
    on_throttle: Throttle = field(default_factory=Throttle)

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT

    def matches(self, domains: Iterable[str], mx_hosts: Iterable[str], hops: Iterable[str]) -> bool:
        if self.domains and any(_domain_match(p, d) for d in domains for p in self.domains):
            return True
        if self.mx and any(_domain_match(p, h) for h in mx_hosts for p in self.mx):
            return True
        return bool(self.next_hops) and any(h in self.next_hops for h in hops)

    def matches_domain(self, domains: Iterable[str]) -> bool:
        return any(_domain_match(p, d) for d in domains for p in self.domains)

    def owns_host(self, mx_name: str, names: Iterable[str]) -> bool:
        """Whether one host of a link is the entry's by itself: ``mx_name`` (its
        name, "" for an address literal) matches ``mx``, or one of its
        ``names`` (``host:port``, ``host``, ``[address]``) is a ``next_hop``."""
        if mx_name and any(_domain_match(p, mx_name) for p in self.mx):
            return True
        return any(n in self.next_hops for n in names)

    def describe(self) -> str:
        parts = [f"{self.max_connections} conn", f"{self.max_messages_per_connection} msg/conn"]
        if self.max_message_rate:
            parts.append(f"{self.max_message_rate} messages")
        if self.max_connection_rate:
            parts.append(f"{self.max_connection_rate} connections")
        return ", ".join(parts)


def _domain_match(pattern: str, name: str) -> bool:
    """``example.com`` exactly, ``.example.com`` / ``*.example.com`` its subdomains."""
    name = name.lower().rstrip(".")
    if pattern.startswith("."):
        return name.endswith(pattern)
    return name == pattern


@dataclass(frozen=True)
class Policy:
    entries: tuple[Entry, ...]
    default: Entry
    source: str = ""  # the file it came from

    @property
    def needs_domains(self) -> bool:
        return any(e.domains for e in self.entries)

    def match(
        self, domains: Iterable[str] = (), mx_hosts: Iterable[str] = (), hops: Iterable[str] = ()
    ) -> Entry:
        """The first entry matching any of the destination's recipient domains,
        MX host names or next-hop names; else the default entry."""
        domains, mx_hosts, hops = list(domains), list(mx_hosts), list(hops)
        for entry in self.entries:
            if entry.matches(domains, mx_hosts, hops):
                return entry
        return self.default


# --- parsing ---------------------------------------------------------------------


def parse_rate(text: Any) -> Rate:
    """``600/h``, ``10/min``, ``5/s``, ``100/10m``: count per period."""
    match = _RATE.match(str(text).lower()) if isinstance(text, str) else None
    if not match or match.group(3) not in _RATE_UNITS or int(match.group(1)) < 1:
        raise ValueError(f"{text!r} is not a rate (e.g. 600/h, 10/min, 5/s)")
    period = int(match.group(2) or 1) * _RATE_UNITS[match.group(3)]
    if period <= 0:
        raise ValueError(f"{text!r} has an empty period")
    return Rate(int(match.group(1)), float(period))


def _seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        if value <= 0:
            raise ValueError(f"{value!r} is not a positive duration")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration (e.g. 30s, 10m)")
    secs = parse_duration(value).total_seconds()
    if secs <= 0:
        raise ValueError(f"{value!r} is not a positive duration")
    return secs


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{value!r} is not a whole number of at least 1")
    return value


def _strings(value: Any, what: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
        raise ValueError(f"expected a {what} or a list of them, got {value!r}")
    return tuple(x.strip() for x in items)


def _patterns(value: Any) -> tuple[str, ...]:
    out = []
    for item in _strings(value, "domain name"):
        item = item.lower().rstrip(".")
        if item.startswith("*."):
            item = item[1:]
        if not item or " " in item or "*" in item:
            raise ValueError(f"{item!r} is not a name, .suffix or *.suffix")
        out.append(item)
    return tuple(out)


def _addresses(value: Any) -> tuple[str, ...]:
    out = []
    for item in _strings(value, "IP address"):
        try:
            out.append(str(ipaddress.ip_address(item.strip("[]"))))
        except ValueError:
            raise ValueError(f"{item!r} is not an IPv4 or IPv6 address") from None
    if len({ipaddress.ip_address(a).version for a in out}) != len(out):
        raise ValueError("at most one IPv4 and one IPv6 source address")
    return tuple(out)


def _throttle(value: Any, where: Callable[[str], int | None]) -> Throttle:
    if value is False or (isinstance(value, str) and value.lower() == "off"):
        return Throttle(enabled=False)
    if not isinstance(value, Mapping):
        raise PolicyError(where(""), f"on_throttle: expected a table or 'off', got {value!r}")
    t = Throttle()
    for key, raw in value.items():
        try:
            if key == "factor" or key == "min_factor":
                if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0 < raw < 1:
                    raise ValueError(f"{raw!r} is not a number between 0 and 1")
                t = replace(t, **{key: float(raw)})
            elif key == "cooldown":
                t = replace(t, cooldown=_seconds(raw))
            elif key == "texts":
                t = replace(t, texts=tuple(x.lower() for x in _strings(raw, "text")))
            else:
                raise ValueError(f"unknown key (known: {', '.join(THROTTLE_KEYS)})")
        except ValueError as exc:
            raise PolicyError(where(key), f"on_throttle.{key}: {exc}") from None
    return t


def _entry(
    name: str, data: Any, base: Entry, where: Callable[[str], int | None], *, default: bool
) -> Entry:
    if not isinstance(data, Mapping):
        raise PolicyError(where(""), f"entry {name!r}: expected a table, got {data!r}")
    allowed = LIMIT_KEYS if default else ("name", *MATCH_KEYS, *LIMIT_KEYS)
    entry = replace(base, name=name, domains=(), mx=(), next_hops=())
    for key, raw in data.items():
        try:
            if key not in allowed:
                raise ValueError(f"unknown key (known: {', '.join(allowed)})")
            if key == "name":
                continue
            if key == "domain":
                entry = replace(entry, domains=_patterns(raw))
            elif key == "mx":
                entry = replace(entry, mx=_patterns(raw))
            elif key == "next_hop":
                entry = replace(entry, next_hops=tuple(x.lower() for x in _strings(raw, "hop")))
            elif key in ("max_connections", "max_messages_per_connection"):
                entry = replace(entry, **{key: _count(raw)})
            elif key in ("max_message_rate", "max_connection_rate"):
                entry = replace(entry, **{key: parse_rate(raw)})
            elif key == "connect_timeout":
                entry = replace(entry, connect_timeout=_seconds(raw))
            elif key == "source_address":
                entry = replace(entry, source_address=_addresses(raw))
            elif key == "helo_name":
                if not isinstance(raw, str) or not raw.strip() or " " in raw.strip():
                    raise ValueError(f"{raw!r} is not a host name")
                entry = replace(entry, helo_name=raw.strip())
            elif key == "on_throttle":
                entry = replace(entry, on_throttle=_throttle(raw, lambda k, base=key: where(base)))
        except ValueError as exc:
            if isinstance(exc, PolicyError):
                raise
            raise PolicyError(where(key), f"entry {name!r}: {key}: {exc}") from None
    if not default and not (entry.domains or entry.mx or entry.next_hops):
        raise PolicyError(where(""), f"entry {name!r} matches nothing: give domain, mx or next_hop")
    return entry


def builtin_default() -> Entry:
    """The default entry when the file gives none: the global settings."""
    from django.conf import settings

    return Entry(
        name=DEFAULT,
        max_connections=int(settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION),
        max_messages_per_connection=int(settings.MAILRELAY_MAX_MESSAGES_PER_CONNECTION),
        connect_timeout=settings.MAILRELAY_SMTP_CONNECT_TIMEOUT.total_seconds(),
    )


def parse(text: str, fmt: str = "yaml", source: str = "") -> Policy:
    """A Policy from the file's text; raises PolicyError (with the line) when unusable."""
    data, lines = _load_yaml(text) if fmt == "yaml" else _load_toml(text)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise PolicyError(1, "expected a table with 'default' and/or 'entries'")
    for key in data:
        if key not in ("default", "entries"):
            raise PolicyError(lines.get((key,)), f"unknown top-level key {key!r}")

    def at(*path: Any) -> Callable[[str], int | None]:
        def where(key: str) -> int | None:
            full = (*path, key) if key else path
            return lines.get(full) or lines.get(path)

        return where

    default = _entry(
        DEFAULT, data.get("default") or {}, builtin_default(), at("default"), default=True
    )
    raw_entries = data.get("entries") or []
    if not isinstance(raw_entries, list):
        raise PolicyError(lines.get(("entries",)), "entries: expected a list of tables")
    entries: list[Entry] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_entries):
        where = at("entries", i)
        name = raw.get("name") if isinstance(raw, Mapping) else None
        if not isinstance(name, str) or not _NAME.match(name) or name == DEFAULT:
            raise PolicyError(
                where("name"),
                f"entry {i + 1}: 'name' must be 1-64 letters, digits, '.', '_', '-' "
                f"(not 'default'), got {name!r}",
            )
        if name in seen:
            raise PolicyError(where("name"), f"entry {name!r} is defined twice")
        seen.add(name)
        entries.append(_entry(name, raw, default, where, default=False))
    return Policy(tuple(entries), default, source)


def _load_yaml(text: str) -> tuple[Any, dict[tuple, int]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(mark.line + 1 if mark else None, f"not valid YAML: {problem}") from None
    lines: dict[tuple, int] = {}
    if node is None:
        return None, lines

    def walk(n: yaml.Node, path: tuple) -> Any:
        lines[path] = n.start_mark.line + 1
        if isinstance(n, yaml.MappingNode):
            out = {}
            for k, v in n.value:
                key = k.value
                out[key] = walk(v, (*path, key))
                lines[(*path, key)] = k.start_mark.line + 1
            return out
        if isinstance(n, yaml.SequenceNode):
            return [walk(v, (*path, i)) for i, v in enumerate(n.value)]
        loader = yaml.SafeLoader("")
        try:
            return loader.construct_object(n, deep=True)
        finally:
            loader.dispose()

    return walk(node, ()), lines


_TOML_HEADER = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.]+)\s*\]\]?")
_TOML_KEY = re.compile(r"^\s*([A-Za-z0-9_]+)\s*=")


def _load_toml(text: str) -> tuple[Any, dict[tuple, int]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"at line (\d+)", str(exc))
        raise PolicyError(
            int(found.group(1)) if found else None, f"not valid TOML: {exc}"
        ) from None
    # tomllib keeps no positions: find the lines of tables and keys by reading
    # the text (good enough for the usual one-key-per-line files).
    lines: dict[tuple, int] = {}
    current: tuple = ()
    entries = -1
    for number, raw in enumerate(text.splitlines(), 1):
        header = _TOML_HEADER.match(raw)
        if header:
            parts = header.group(1).split(".")
            if raw.strip().startswith("[[") and parts == ["entries"]:
                entries += 1
                current = ("entries", entries)
            elif parts[0] == "entries" and entries >= 0:
                current = ("entries", entries, *parts[1:])
            else:
                current = tuple(parts)
            lines.setdefault(current, number)
            continue
        key = _TOML_KEY.match(raw)
        if key:
            lines.setdefault((*current, key.group(1)), number)
    return data, lines


def read(path: str) -> Policy:
    """The policy in ``path`` (YAML unless it ends in .toml)."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    fmt = "toml" if path.lower().endswith(".toml") else "yaml"
    return parse(text, fmt, source=path)


def seconds_text(secs: float) -> str:
    return str(timedelta(seconds=round(secs)))
