"""Incidents across queues: deferrals grouped by normalised error and by the
provider behind the MX.

The provider of a queue is the registered domain of its link's MX hosts (the
most preferred host's), so ``*.mail.protection.outlook.com`` is one provider,
``outlook.com``, across every customer domain that points there. The hosts
come from ``Link.hosts`` as the categorizer stored them: no DNS lookup here.
The registered domain is the last two labels, or three under a common
two-letter country second level (``co.uk``, ``com.au``, ...): a heuristic,
without the public suffix list.

While the queue is small the incidents are aggregated live from
``insight.groups.compute`` (one GROUP BY plus one query for the queues'
links). At scale the periodic refresh aggregates them from every group and
stores the largest ``INCIDENTS_STORED`` of each kind (``IncidentSummary``), so
a read is one indexed query per kind, whatever the number of queues. An
incident lists its largest ``QUEUES_SHOWN`` queues and says how many it spans.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from insight.groups import TREND_SLICES, Group, compute, stored_in_use
from insight.models import IncidentSummary
from queues.models import Queue

SECOND_LEVELS = frozenset({"co", "com", "net", "org", "gov", "ac", "edu", "ne", "or", "go"})
NO_ROUTE = "(no route)"
INCIDENTS_STORED = 500  # per kind (by provider, by error) in the stored summary
QUEUES_SHOWN = 20  # per incident: its largest queues (queue_count: all of them)


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
    # {"id", "name", "recipients"}, the largest first once ranked (QUEUES_SHOWN when stored)
    queues: list[dict[str, Any]] = field(default_factory=list)
    queue_count: int = 0
    recipients: int = 0
    senders: int = 0
    first_seen: datetime | None = None
    last_seen: datetime | None = None
    trend: list[int] = field(default_factory=lambda: [0] * TREND_SLICES)

    def add(self, g: Group) -> None:
        code = " ".join(str(p) for p in (g.code, g.enhanced) if p)
        if code and code not in self.codes:
            self.codes.append(code)
        for q in self.queues:
            if q["id"] == g.queue_id:
                q["recipients"] += g.recipients
                break
        else:
            self.queues.append({"id": g.queue_id, "name": g.queue_name, "recipients": g.recipients})
            self.queue_count += 1
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

    def rank_queues(self) -> None:
        """The largest queues first, at most QUEUES_SHOWN of them."""
        self.queues = sorted(self.queues, key=lambda q: (-q["recipients"], q["name"]))
        self.queues = self.queues[:QUEUES_SHOWN]

    def stored(self, by_error: bool) -> IncidentSummary:
        return IncidentSummary(
            by_error=by_error,
            provider=self.provider[:255],
            error=self.error,
            codes=self.codes,
            queues=self.queues,
            queue_count=self.queue_count,
            recipients=self.recipients,
            senders=self.senders,
            first_seen=self.first_seen,
            last_seen=self.last_seen,
            trend=self.trend,
        )

    @classmethod
    def from_stored(cls, row: IncidentSummary) -> Incident:
        return cls(
            row.provider,
            row.error,
            list(row.codes),
            list(row.queues),
            row.queue_count,
            row.recipients,
            row.senders,
            row.first_seen,
            row.last_seen,
            list(row.trend) or [0] * TREND_SLICES,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "error": self.error,
            "codes": self.codes,
            "queues": self.queues,
            "queue_count": self.queue_count,
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


def aggregate(groups: list[Group], limit: int) -> tuple[list[Incident], list[Incident]]:
    """The incidents of these deferral groups, by provider and error and by error
    alone, the largest ``limit`` of each (queues named, ranked)."""
    providers = queue_providers({g.queue_id for g in groups})
    by_provider: dict[tuple[str, str], Incident] = {}
    by_error: dict[str, Incident] = {}
    for g in groups:
        provider = providers.get(g.queue_id, g.queue_name)
        by_provider.setdefault((provider, g.text), Incident(provider, g.text)).add(g)
        by_error.setdefault(g.text, Incident("", g.text)).add(g)

    def ranked(items) -> list[Incident]:
        top = sorted(items, key=lambda i: (-i.recipients, i.provider, i.error))[:limit]
        for i in top:
            i.rank_queues()
        return top

    return ranked(by_provider.values()), ranked(by_error.values())


def incidents(now: datetime, limit: int = 200) -> Incidents:
    """Live below MAILRELAY_INSIGHT_LIVE_LIMIT deferred recipients, else the stored
    summary of the last refresh (two indexed queries; ``as_of`` says when)."""
    state = stored_in_use(now)
    if state is None:
        groups = compute(now)
        by_provider, by_error = aggregate(groups, limit)
        return Incidents(by_provider, by_error, None, sum(g.recipients for g in groups))
    rows = IncidentSummary.objects.order_by("-recipients", "id")

    def read(by_error: bool) -> list[Incident]:
        return [Incident.from_stored(r) for r in rows.filter(by_error=by_error)[:limit]]

    return Incidents(read(False), read(True), state.computed_at, state.deferred)
