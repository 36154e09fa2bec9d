"""python manage.py queue list|retry|resubmit|suspend|resume|reroute|unroute

queue list --status retry
queue retry example.net
queue suspend 12 14
queue suspend example.net --until 2h              # resumes by itself in two hours
queue reroute example.net --to '[10.0.0.9]:25' --until 2026-05-01T08:00:00Z
queue unroute example.net                         # back to its own next hop now
queue resubmit 12 14 --dry-run                    # what it would do; nothing changes
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from queues.filters import QUEUE_FILTERS, QueueFilter, queue_status, queues_page
from queues.holdings import next_attempts
from queues.lib import clock
from queues.management.commands.message import add_actor_option, cli_actor
from queues.models import Queue
from queues.paging import FilterError, parse_limit
from queues.services.actions import ActionConflict, ActionInvalid, Via, timed_notes
from queues.services.counts import current_counts
from queues.services.preview_sample import sample_lines
from queues.spec import (
    QUEUE_ACTIONS,
    actions_for,
    add_action_options,
    add_cli_filters,
    cli_options,
    cli_params,
)

CLI_ACTIONS = actions_for(QUEUE_ACTIONS, "cli")


def queue_by_ref(ref: str) -> Queue:
    """A queue by id, or by name when exactly one queue has it."""
    qs = Queue.objects.select_related("link")
    if ref.isdigit():
        try:
            return qs.get(pk=int(ref))
        except Queue.DoesNotExist:
            raise CommandError(f"no queue {ref!r}") from None
    found = list(qs.filter(name__iexact=ref))
    if not found:
        raise CommandError(f"no queue named {ref!r}")
    if len(found) > 1:
        ids = ", ".join(f"{q.pk} ({q.delivery_type})" for q in found)
        raise CommandError(f"several queues are named {ref!r}: use an id: {ids}")
    return found[0]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


class Command(BaseCommand):
    help = "List queues and act on them (retry now, resubmit, suspend, resume, re-route)."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="command", required=True)
        p = sub.add_parser("list", help="queues, largest first")
        add_cli_filters(p, QUEUE_FILTERS)
        p.add_argument("--sort", help="name, count, type, incoming, outgoing, id (default -count)")
        p.add_argument("--limit", default="1000")
        p.add_argument("--json", action="store_true")
        for spec in CLI_ACTIONS.values():
            p = sub.add_parser(spec.name, help=spec.help)
            p.add_argument("queues", nargs="+", help="queue ids or names")
            add_actor_option(p)
            add_action_options(p, spec)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["command"] == "list":
            self._list(options)
            return
        actor = cli_actor(options)
        spec = CLI_ACTIONS[options["command"]]
        given = cli_options(options)
        if options.get("dry_run"):
            self._dry_run(spec, options, given)
            return
        failed = False
        for ref in options["queues"]:
            queue = queue_by_ref(ref)
            try:
                count = spec.run(queue, actor, Via.CLI, **given)
            except ActionInvalid as exc:
                raise CommandError(exc.message) from None
            except ActionConflict as exc:
                self.stderr.write(f"{queue.name}: {exc.message}")
                failed = True
                continue
            self.stdout.write(f"{options['command']}: {queue.name} ({count} messages)")
        if failed:
            raise CommandError("some queues were not changed")

    def _dry_run(self, spec, options: dict[str, Any], given: dict[str, Any]) -> None:
        """What the action would do to these queues (its own selection); nothing changes."""
        ids = [queue_by_ref(ref).pk for ref in options["queues"]]
        try:
            preview = spec.dry_run(Queue.objects.filter(pk__in=ids), **given)
        except ActionConflict as exc:
            raise CommandError(exc.message) from None
        name = options["command"]
        self.stdout.write(
            f"{name} would touch {preview.count} queues; run again without --dry-run to do it"
        )
        for line in preview.lines("queues")[1:]:
            self.stdout.write(f"  {line}")
        if preview.sample:
            self.stdout.write(f"  the first {len(preview.sample)} messages it would touch:")
            for line in sample_lines(list(preview.sample)):
                self.stdout.write(f"  {line}")

    def _list(self, options: dict[str, Any]) -> None:
        now = clock.now()
        counts = current_counts(now)  # before the rows are read: their counts are this one
        try:
            f = QueueFilter.from_params(cli_params(options, QUEUE_FILTERS))
            page = queues_page(
                f, options.get("sort"), None, parse_limit(options["limit"], 1000, 100000)
            )
        except FilterError as exc:
            raise CommandError(str(exc)) from None
        nexts = next_attempts(page.items)
        if options["json"]:
            from queues.api.serializers import QueueSerializer

            context = {"counts": counts, "next_attempts": nexts}
            for row in QueueSerializer(page.items, many=True, context=context).data:
                self.stdout.write(json.dumps(row, default=str))
            return
        self.stdout.write(
            f"{'ID':>6} {'NAME':32} {'TYPE':13} {'STATUS':9} {'MSGS':>7} {'IN/m':>7} "
            f"{'OUT/m':>7} {'OLDEST':>6} {'NEXT ATTEMPT':19} LAST ERROR"
        )
        for q in page.items:
            oldest = (now - q.oldest_received_at).total_seconds() if q.oldest_received_at else None
            link = q.link if q.link_id else None
            # The earliest next attempt over what it holds, not before the link's retry.
            next_at = nexts.get(q.pk)
            retry_at = f"{next_at:%Y-%m-%d %H:%M:%S}" if next_at else "-"
            error = (link.last_error if link and link.state == "retry" else "") or q.last_error
            self.stdout.write(
                f"{q.pk:>6} {q.name[:32]:32} {q.delivery_type:13} {queue_status(q):9} "
                f"{q.message_count:>7} {q.incoming_rate:>7.1f} {q.outgoing_rate:>7.1f} "
                f"{_age(oldest):>6} {retry_at:19} {' '.join(error.split())[:60]}"
            )
            for note in timed_notes(q, now):
                self.stdout.write(f"{'':>6} {note}")
        if not counts.exact:
            self.stdout.write(f"message counts {counts.text(now)} (the sweep's recount)")
