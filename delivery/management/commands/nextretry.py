"""``nextretry DOMAIN``: the retry data kept for a domain's hosts (Exim's ``exinext``)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Q

from queues.lib import clock, format_duration
from queues.models import Link, Queue, RetryHint


class Command(BaseCommand):
    help = "Show the retry hints of a domain's next hops and addresses (like exinext)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("domain", help="a destination domain, e.g. example.com")

    def handle(self, *args, domain: str, **options) -> None:
        domain = domain.lower().rstrip(".")
        now = clock.now()
        links = Link.objects.filter(queues__in=Queue.objects.filter(name=domain)).distinct()
        hosts = {h["host"].lower().rstrip(".") for link in links for h in link.hosts}
        for link in links:
            state = link.get_state_display()
            when = (
                f", next retry {link.next_retry_at:%Y-%m-%d %H:%M:%S}" if link.next_retry_at else ""
            )
            self.stdout.write(f"Link {link.name}: {state}{when}")
            if link.last_error:
                self.stdout.write(f"  last error: {link.last_error}")
        query = Q(key__startswith=f"R:{domain}") | Q(key__contains=f"@{domain}:")
        query |= Q(key__endswith=f"@{domain}")
        for host in hosts:
            query |= Q(key__startswith=f"T:{host}:") | Q(key=f"T:{host}")
        hints = list(RetryHint.objects.filter(query).order_by("key"))
        if not hints and not links:
            self.stdout.write(f"No retry data for {domain}.")
            return
        for hint in hints:
            due = hint.next_try - now
            when = "now" if due.total_seconds() <= 0 else f"in {format_duration(due)}"
            self.stdout.write(
                f"{hint.key}  error={hint.error or '*'}  first failed "
                f"{hint.first_failed:%Y-%m-%d %H:%M:%S}  last tried "
                f"{hint.last_tried:%Y-%m-%d %H:%M:%S}  next try "
                f"{hint.next_try:%Y-%m-%d %H:%M:%S} ({when})"
                + ("  *expired*" if hint.expired else "")
            )
            if hint.text:
                self.stdout.write(f"  {hint.text}")
