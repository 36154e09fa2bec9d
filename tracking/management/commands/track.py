"""``python manage.py track --sender … --recipient … --message-id … --since 2d``."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from tracking.eventlog import as_dict
from tracking.search import MAX_LIMIT, SearchError, parse_query, search


class Command(BaseCommand):
    help = (
        "Search the message tracking log (newest first): by sender, recipient, Message-ID, "
        "queue id, remote queue id, event and time."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--sender", default="")
        parser.add_argument("--recipient", default="")
        parser.add_argument("--message-id", dest="message_id", default="")
        parser.add_argument("--qid", default="", help="our queue id")
        parser.add_argument(
            "--remote-id", dest="remote_id", default="", help="the next hop's queue id"
        )
        parser.add_argument("--event", default="", help="comma list, e.g. delivered,failed")
        parser.add_argument("--since", default="", help="2d, 90m or an ISO time")
        parser.add_argument("--until", default="", help="2d, 90m or an ISO time")
        parser.add_argument("--limit", type=int, default=100)
        parser.add_argument("--json", action="store_true", help="one JSON object a line")

    def handle(self, *args, **options) -> None:
        params = {
            k: options[k]
            for k in (
                "sender",
                "recipient",
                "message_id",
                "qid",
                "remote_id",
                "event",
                "since",
                "until",
            )
        }
        try:
            query = parse_query(params)
            remaining = options["limit"]
            cursor = None
            while remaining > 0:
                page = search(query, min(remaining, MAX_LIMIT), cursor)
                for row in page.rows:
                    self._print(row, options["json"])
                remaining -= len(page.rows)
                cursor = page.next_cursor
                if not cursor:
                    break
        except SearchError as exc:
            raise CommandError(str(exc)) from None

    def _print(self, row, as_json: bool) -> None:
        if as_json:
            self.stdout.write(json.dumps(as_dict(row), default=str, ensure_ascii=False))
            return
        where = ""
        if row.event == "received":
            where = f"client={row.client or '-'} size={row.size}" + (
                f" account={row.account}" if row.account else ""
            )
        elif row.event == "operator":
            where = f"{row.detail.get('action', '')} by {row.actor}"
        else:
            parts = [
                row.queue and f"queue={row.queue}",
                row.next_hop and f"via={row.next_hop}",
                row.host and f"host={row.host}[{row.ip}]",
                row.tls and f"tls={row.tls}",
            ]
            where = " ".join(p for p in parts if p)
        reply = f" reply={row.reply!r}" if row.reply else ""
        remote = f" remote_id={row.remote_id}" if row.remote_id else ""
        self.stdout.write(
            f"{row.at:%Y-%m-%d %H:%M:%S} {row.qid or '-'} {row.event} "
            f"from=<{row.sender}> to=<{row.recipient}> {where}{reply}{remote}".rstrip()
        )
