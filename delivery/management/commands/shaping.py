"""``shaping``: the traffic shaping policy in force, and what applies to a domain.

    python manage.py shaping show
    python manage.py shaping test example.com

``test`` routes the domain as the categorizer would (transport map, smart
host, else DNS MX), matches the policy entries (first match wins, then the
default entry) and prints the entry's limits and the effective limits now
(after throttling replies: the adaptive factor kept in Redis).
"""

from __future__ import annotations

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from delivery.route.routing import RouteError
from delivery.shaping import adaptive, gate, policy
from delivery.shaping.limiter import Status, limiter
from delivery.shaping.policy import Entry
from queues.lib import clock
from queues.models import Link


def _status(entry: Entry, link_id: int | None) -> Status | None:
    lim = limiter()
    if lim is None or (entry.is_default and link_id is None):
        return None
    periods = (
        entry.max_message_rate.period if entry.max_message_rate else 0.0,
        entry.max_connection_rate.period if entry.max_connection_rate else 0.0,
    )
    try:
        return lim.status(gate.scope_of(entry, link_id), clock.now().timestamp(), periods)
    except (redis.RedisError, OSError):
        return None


def _entry_lines(entry: Entry) -> list[str]:
    match = []
    for label, values in (
        ("domain", entry.domains),
        ("mx", entry.mx),
        ("next_hop", entry.next_hops),
    ):
        if values:
            match.append(f"{label} {', '.join(values)}")
    lines = [f"entry: {entry.name}" + (f" ({'; '.join(match)})" if match else "")]
    lines.append(f"  configured: {entry.describe()}")
    extra = [f"connect_timeout {entry.connect_timeout:g}s"]
    if entry.source_address:
        extra.append(f"source_address {', '.join(entry.source_address)}")
    if entry.helo_name:
        extra.append(f"helo_name {entry.helo_name}")
    t = entry.on_throttle
    extra.append(
        f"on_throttle x{t.factor:g} for {t.cooldown:g}s (min x{t.min_factor:g})"
        if t.enabled
        else "on_throttle off"
    )
    lines.append("  " + ", ".join(extra))
    return lines


class Command(BaseCommand):
    help = "Show the traffic shaping policy, or which entry applies to a domain and its limits now."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["show", "test"])
        parser.add_argument("domain", nargs="?", help="for test: a recipient domain")

    def handle(self, *args, **options) -> None:
        pol = gate.current()
        if pol is None:
            self.stdout.write(
                "MAILRELAY_SHAPING is not set: every next hop gets "
                f"{settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION} connections of "
                f"{settings.MAILRELAY_MAX_MESSAGES_PER_CONNECTION} messages, no shared counters."
            )
            return
        if gate.last_error():
            self.stderr.write(f"NOT IN FORCE: {gate.last_error()}")
        if options["action"] == "show":
            self._show(pol)
        else:
            if not options["domain"]:
                raise CommandError("shaping test needs a domain")
            self._test(pol, options["domain"])

    def _show(self, pol: policy.Policy) -> None:
        self.stdout.write(f"policy: {pol.source} ({len(pol.entries)} entries, first match wins)")
        for entry in (*pol.entries, pol.default):
            for line in _entry_lines(entry):
                self.stdout.write(line)
            if not entry.is_default:
                self.stdout.write(
                    f"  effective now: {adaptive.describe(entry, _status(entry, None))}"
                )
        self.stdout.write("  (the default entry limits each next hop on its own)")

    def _test(self, pol: policy.Policy, domain: str) -> None:
        from delivery.route.routing import DNS_MX, Router

        try:
            route = Router.from_settings().route(domain)
        except RouteError as exc:
            raise CommandError(f"{domain}: no route: {exc.text}") from exc
        hosts = [h.as_json() for h in route.hosts]
        what = gate.destination(route.link_name, hosts, (route.queue_name,))
        entry = pol.match(**what)
        via = "MX" if route.delivery_type == DNS_MX else route.delivery_type
        self.stdout.write(f"domain: {route.queue_name}")
        self.stdout.write(f"next hop ({via}): {route.link_name}")
        for line in _entry_lines(entry):
            self.stdout.write(line)
        link = Link.objects.filter(name=route.link_name).values_list("id", flat=True).first()
        status = _status(entry, link)
        self.stdout.write(f"  effective now: {adaptive.describe(entry, status)}")
        if status is not None:
            self.stdout.write(
                f"  in use: {status.connections} connections, "
                f"{status.messages_in_window} messages and "
                f"{status.connections_in_window} connections in the current windows"
            )
