"""Incidents across queues: deferrals grouped by normalised error and by the
provider behind the MX.

The provider of a queue is the registered domain of its link's MX hosts (the
most preferred host's), so ``*.mail.protection.outlook.com`` is one provider,
``outlook.com``, across every customer domain that points there. The hosts
come from ``Link.hosts`` as the categorizer stored them: no DNS lookup here.
The registered domain is the last two labels, or three under a common
two-letter country second level (``co.uk``, ``com.au``, ...): a heuristic,
without the public suffix list.

The deferral groups come from ``insight.deferrals`` (live, or the refreshed
summary at scale), so an incidents view costs what ``/deferrals/`` costs plus
one query for the queues' links.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from insight.deferrals import TREND_SLICES, Group, deferral_groups
from queues.models import Queue

SECOND_LEVELS = frozenset({"co", "com", "net", "org", "gov", "ac", "edu", "ne", "or", "go"})
NO_ROUTE = "(no route)"


def registered_domain(host: str) -> str:
    """``mx1.eu.mail.protection.outlook.com`` -> ``outlook.com`` (see the module doc)."""
    host = host.strip().lower().rstrip(".").strip("[]")
    try:
        ipaddress.ip_address(host)
        return host  # an address literal is its own provider
    except ValueError:
        pass
    labels = [x for x in host.split(".") if x]
    if len(labels) <= 2:
        return ".".join(labels)
    if len(labels[-1]) == 2 and labels[-2] in SECOND_LEVELS:
        return ".".join(labels[-3:])
    return ".".join(labels[-2:])


def queue_providers(queue_ids: set[int]) -> dict[int, str]:
    """The provider behind each queue (one query: the queues with their links)."""
    out: dict[int, str] = {}
    for q in Queue.objects.filter(id__in=queue_ids).select_related("link"):
        link = q.link
        if link is None:
            out[q.pk] = NO_ROUTE if q.delivery_type == "unreachable" else q.name
            continue
        hosts = sorted(link.hosts or [], key=lambda h: (h.get("preference", 0), h.get("host", "")))
        name = hosts[0].get("host", "") if hosts else link.name
        out[q.pk] = registered_domain(str(name)) or link.name
    return out


@dataclass
class Incident:
    provider: str  # "" when grouped by error only
    error: str  # normalised
    codes: list[str] = field(default_factory=list)
    queues: list[dict[str, Any]] = field(default_factory=list)
    recipients: int = 0
    senders: int = 0
    first_seen: datetime | None = None
    last_seen: datetime | None = None
    trend: list[int] = field(default_factory=lambda: [0] * TREND_SLICES)

    def add(self, g: Group) -> None:
        code = " ".join(str(p) for p in (g.code, g.enhanced) if p)
        if code and code not in self.codes:
            self.codes.append(code)
        if all(q["id"] != g.queue_id for q in self.queues):
            self.queues.append({"id": g.queue_id, "name": g.queue_name})
        self.recipients += g.recipients
        self.senders += g.senders
        if g.first_seen and (self.first_seen is None or g.first_seen < self.first_seen):
            self.first_seen = g.first_seen
        if g.last_seen and (self.last_seen is None or g.last_seen > self.last_seen):
            self.last_seen = g.last_seen
        self.trend = [a + b for a, b in zip(self.trend, g.trend, strict=False)]

    @property
    def direction(self) -> str:
        """rising / falling / steady: the last 20 minutes against the 20 before."""
        recent, before = sum(self.trend[-2:]), sum(self.trend[-4:-2])
        if recent > before * 1.2 + 1:
            return "rising"
        if before > recent * 1.2 + 1:
            return "falling"
        return "steady"

    def as_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "error": self.error,
            "codes": self.codes,
            "queues": sorted(self.queues, key=lambda q: q["name"]),
            "recipients": self.recipients,
            "senders": self.senders,
            "first_seen": self.first_seen.isoformat() if self.first_seen else None,
            "last_seen": self.last_seen.isoformat() if self.last_seen else None,
            "trend": self.trend,
            "trend_direction": self.direction,
        }


@dataclass
class Incidents:
    by_provider: list[Incident]
    by_error: list[Incident]
    as_of: datetime | None
    deferred: int


def incidents(now: datetime, limit: int = 200) -> Incidents:
    found = deferral_groups(now)
    providers = queue_providers({g.queue_id for g in found.groups})
    by_provider: dict[tuple[str, str], Incident] = {}
    by_error: dict[str, Incident] = {}
    for g in found.groups:
        provider = providers.get(g.queue_id, g.queue_name)
        by_provider.setdefault((provider, g.text), Incident(provider, g.text)).add(g)
        by_error.setdefault(g.text, Incident("", g.text)).add(g)

    def ranked(items) -> list[Incident]:
        return sorted(items, key=lambda i: (-i.recipients, i.provider, i.error))[:limit]

    return Incidents(
        ranked(by_provider.values()), ranked(by_error.values()), found.as_of, found.deferred
    )
