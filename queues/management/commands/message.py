"""python manage.py message list|show|explain|suspend|resume|resubmit|remove|export

The command-line edge of the Queue Viewer: the same filters (one option per
row of queues.filters.MESSAGE_FILTERS) and the same actions (one subcommand
per entry of queues.spec.MESSAGE_ACTIONS) as the UI and the REST API,
written to the audit log with via="cli". Without --yes a filter action only
says how many messages it would change (the action's own count).

    message list --domain example.net --status retry
    message show 0B3KQ7T2M9XCVD
    message explain 0B3KQ7T2M9XCVD                              # why it waits, what comes next
    message suspend 0B3KQ7T2M9XCVD 0B3KQ7T2M9XCVF
    message remove --sender spammer@example.org --ndr          # shows the count
    message remove --sender spammer@example.org --ndr --yes    # does it
    message remove 0B3KQ7T2M9XCVD --ndr --dry-run              # what it would do, in detail
    message suspend 0B3KQ7T2M9XCVD --until 2h                  # resumes by itself in 2 hours
    message resubmit 0B3KQ7T2M9XCVD --set-recipient right@example.net   # a dead letter, fixed
    message export 0B3KQ7T2M9XCVD > copy.eml
    message export --queue 12 --zip queue12.zip
"""

from __future__ import annotations

import getpass
import json
import sys
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import QuerySet

from queues.filters import MESSAGE_FILTERS, MessageFilter, messages_page, messages_prefetch
from queues.models import Message
from queues.paging import FilterError, parse_limit
from queues.services import actions
from queues.services.actions import ActionConflict, ActionTooLarge, Via
from queues.services.preview_sample import sample_lines
from queues.spec import (
    MESSAGE_ACTIONS,
    actions_for,
    add_action_options,
    add_cli_filters,
    cli_options,
    cli_params,
)

CLI_ACTIONS = actions_for(MESSAGE_ACTIONS, "cli")


def add_actor_option(parser: CommandParser) -> None:
    parser.add_argument(
        "--user",
        help="the Django user to record in the audit log (default: the shell's user name)",
    )


def cli_actor(options: dict[str, Any]):
    name = options.get("user")
    if not name:
        return getpass.getuser()
    try:
        return get_user_model().objects.get_by_natural_key(name)
    except get_user_model().DoesNotExist:
        raise CommandError(f"no user {name!r}") from None


def add_filter_options(parser: CommandParser) -> None:
    add_cli_filters(parser.add_argument_group("filters (all must match)"), MESSAGE_FILTERS)


def filter_from_options(options: dict[str, Any]) -> MessageFilter:
    try:
        return MessageFilter.from_params(cli_params(options, MESSAGE_FILTERS))
    except FilterError as exc:
        raise CommandError(str(exc)) from None


def message_by_ref(ref: str) -> Message:
    """A message by numeric id or by queue id."""
    qs = Message.objects.defer("data")
    try:
        if ref.isdigit():
            return qs.get(pk=int(ref))
        return qs.get(qid=ref.upper())
    except Message.DoesNotExist:
        raise CommandError(f"no message {ref!r}") from None


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


class Command(BaseCommand):
    help = "List, show and act on messages (the same filters and actions as the Queue Viewer)."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="command", required=True)

        p = sub.add_parser("list", help="messages matching the filters, newest first")
        add_filter_options(p)
        p.add_argument("--sort", help="received, size, id; - for descending (default -received)")
        p.add_argument("--limit", default="50", help="rows (default 50, at most 500)")
        p.add_argument("--cursor", help="continue after a previous page (printed at its end)")
        p.add_argument("--json", action="store_true", help="one JSON object per line")

        p = sub.add_parser("show", help="one message: envelope, recipients, attempts")
        p.add_argument("message", help="message id or queue id")
        p.add_argument("--json", action="store_true")

        for spec in CLI_ACTIONS.values():
            p = sub.add_parser(spec.name, help=spec.help)
            p.add_argument("messages", nargs="*", help="message ids or queue ids")
            add_filter_options(p)
            p.add_argument(
                "--yes", action="store_true", help="act on the filter (without: only count)"
            )
            add_actor_option(p)
            if spec.takes_ndr:
                p.add_argument("--ndr", action="store_true", help="send a non-delivery report")
            add_action_options(p, spec)

        p = sub.add_parser("explain", help="why each recipient still waits, and what comes next")
        p.add_argument("message", help="message id or queue id")
        p.add_argument("--json", action="store_true")

        p = sub.add_parser("export", help="a message as .eml, or a selection as a zip")
        p.add_argument("message", nargs="?", help="message id or queue id")
        add_filter_options(p)
        p.add_argument("-o", "--output", help="file to write (default: standard output)")
        p.add_argument("--zip", help="write the messages matching the filters into this zip")
        p.add_argument(
            "--form",
            choices=["received", "sent"],
            default="received",
            help="the bytes as received (default), or as sent (with the DKIM-Signature)",
        )
        add_actor_option(p)

    def handle(self, *args: Any, **options: Any) -> None:
        command = options["command"]
        if command == "list":
            self._list(options)
        elif command == "show":
            self._show(options)
        elif command == "export":
            self._export(options)
        elif command == "explain":
            from insight.cli import explain_text  # operator insight (insight/)

            self.stdout.write(explain_text(message_by_ref(options["message"]), options["json"]))
        else:
            self._act(command, options)

    # --- reading ---

    def _list(self, options: dict[str, Any]) -> None:
        f = filter_from_options(options)
        try:
            limit = parse_limit(options["limit"])
            page = messages_page(f, options.get("sort"), options.get("cursor"), limit)
        except FilterError as exc:
            raise CommandError(str(exc)) from None
        recipients = messages_prefetch(page.items)
        for m in page.items:
            m._recipients = recipients[m.pk]
        if options["json"]:
            from queues.api.serializers import MessageListSerializer

            for row in MessageListSerializer(page.items, many=True, context={"content": True}).data:
                self.stdout.write(json.dumps(row, default=str))
            if page.next_cursor:
                self.stderr.write(f"next: --cursor {page.next_cursor}")
            return
        from queues.filters import message_status

        self.stdout.write(
            f"{'ID':>8} {'QUEUE ID':14} {'STATUS':10} {'RECEIVED':19} {'SIZE':>8} "
            f"{'SENDER':28} {'RECIPIENTS':30} SUBJECT"
        )
        for m in page.items:
            rcpts = m._recipients
            status = message_status(m, [r.state for r in rcpts])
            to = ", ".join(r.address for r in rcpts[:3]) + (" …" if len(rcpts) > 3 else "")
            self.stdout.write(
                f"{m.pk:>8} {m.qid:14} {status:10} {m.received_at:%Y-%m-%d %H:%M:%S} "
                f"{m.size:>8} {_short(m.mail_from or '<>', 28):28} {_short(to, 30):30} "
                f"{_short(m.subject, 40)}"
            )
        if page.next_cursor:
            self.stdout.write(f"more: --cursor {page.next_cursor}")

    def _show(self, options: dict[str, Any]) -> None:
        from queues.api.serializers import MessageDetailSerializer

        message = message_by_ref(options["message"])
        data = MessageDetailSerializer(message, context={"content": True}).data
        if options["json"]:
            self.stdout.write(json.dumps(data, default=str, indent=2))
            return
        out = self.stdout.write
        env = data["envelope"]
        out(f"message {data['qid']} (id {data['id']}): {data['status']}")
        out(f"  from      <{env['mail_from']}>  source {data['source']}")
        out(f"  client    {env['client_address']} helo {env['client_helo']}")
        dsn = {k: env[k] for k in ("ret", "envid", "body", "smtputf8", "size") if env[k]}
        if dsn:
            out("  esmtp     " + " ".join(f"{k.upper()}={v}" for k, v in dsn.items()))
        out(f"  subject   {data['subject']}")
        out(f"  msg-id    {data['message_id']}")
        out(f"  size      {data['size']}  received {data['received_at']}")
        out(f"  expires   {data['expires_at']}")
        out("recipients:")
        for r in data["recipients"]:
            queue = r["queue"]["name"] if r["queue"] else "-"
            reply = " ".join(str(x) for x in (r["last_code"], r["last_enhanced"]) if x)
            out(
                f"  {r['address']}  {r['state']}  queue {queue}  tries {r['attempt_count']}"
                + (f"  next {r['next_attempt_at']}" if r["state"] in ("queued", "deferred") else "")
                + (f"  last: {reply} {r['last_text']}" if r["last_text"] else "")
            )
        if data["attempts"]:
            out("attempts:")
            by_id = {r["id"]: r["address"] for r in data["recipients"]}
            for a in data["attempts"]:
                out(
                    f"  {a['started_at']}  {by_id.get(a['recipient_id'], '?')}  {a['outcome']}  "
                    f"{a['phase']}  {a['host']} [{a['ip']}]  {a['code'] or ''} {a['enhanced']} "
                    f"{a['text']}"
                )
        if data["events"]:
            out("events:")
            for e in data["events"]:
                out(f"  {e['created_at']}  {e['level']}  {e['kind']}  {e['text']}")

    def _export(self, options: dict[str, Any]) -> None:
        actor = cli_actor(options)
        if options.get("zip"):
            f = filter_from_options(options)
            if options.get("message"):
                qs: QuerySet[Message] = Message.objects.filter(
                    pk=message_by_ref(options["message"]).pk
                )
            elif f.is_empty():
                raise CommandError("give a message or filters for --zip")
            else:
                qs = f.queryset()
            try:
                with open(options["zip"], "wb") as out:
                    n = actions.messages_export_zip(qs, out, actor, Via.CLI, filter=f.as_params())
            except ActionTooLarge as exc:
                raise CommandError(str(exc)) from None
            self.stderr.write(f"{n} messages written to {options['zip']}")
            return
        if not options.get("message"):
            raise CommandError("give a message id or queue id (or filters with --zip)")
        message = message_by_ref(options["message"])
        data = actions.message_export(
            message, "eml", actor=actor, via=Via.CLI, form=options.get("form") or "received"
        )
        if options.get("output"):
            with open(options["output"], "wb") as out:
                out.write(data)
        else:
            stream = getattr(self.stdout, "_out", sys.stdout)
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                buffer.write(data)
                buffer.flush()
            else:  # a text stream (tests): the bytes as latin-1 keep every octet
                stream.write(data.decode("latin-1"))

    # --- acting ---

    def _act(self, command: str, options: dict[str, Any]) -> None:
        spec = CLI_ACTIONS[command]
        actor = cli_actor(options)
        refs = options.get("messages") or []
        f = filter_from_options(options)
        ndr = bool(options.get("ndr"))
        given = cli_options(options)
        if refs and not f.is_empty():
            raise CommandError("give message ids or filters, not both")
        try:
            self._act_on(spec, command, actor, refs, f, ndr, given, options)
        except ActionConflict as exc:  # ActionInvalid too: a bad option
            raise CommandError(exc.message) from None

    def _act_on(self, spec, command, actor, refs, f, ndr, given, options) -> None:
        if len(refs) == 1 and not options.get("dry_run"):
            message = message_by_ref(refs[0])
            spec.run(message, actor, Via.CLI, ndr=ndr, **given)
            self.stdout.write(f"{command}: {message.qid} done")
            return
        if refs:
            ids = [message_by_ref(r).pk for r in refs]
            qs = Message.objects.filter(id__in=ids)
            if options.get("dry_run"):
                self._preview(spec, command, qs, ndr, given, "--dry-run")
                return
            count = spec.apply(qs, actor, Via.CLI, ndr=ndr, ids=ids, **given)
            self.stdout.write(f"{command}: {count} of {len(ids)} messages changed")
            return
        if f.is_empty():
            raise CommandError("give message ids or at least one filter")
        qs = f.queryset()
        if not options["yes"] or options.get("dry_run"):
            self._preview(spec, command, qs, ndr, given, "--yes")
            return
        count = spec.apply(qs, actor, Via.CLI, ndr=ndr, filter=f.as_params(), **given)
        self.stdout.write(f"{command}: {count} messages changed")

    def _preview(self, spec, command, qs, ndr, given, flag: str) -> None:
        """The action's own preview: what it changes, skips, fails and notifies."""
        preview = spec.dry_run(qs, ndr=ndr, **given)
        how = "run again with --yes to do it" if flag == "--yes" else "run again without it"
        self.stdout.write(f"{command} would touch {preview.count} messages; {how}")
        for line in preview.lines("messages")[1:]:
            self.stdout.write(f"  {line}")
        if preview.sample:
            self.stdout.write(f"  the first {len(preview.sample)} messages it would touch:")
            for line in sample_lines(list(preview.sample)):
                self.stdout.write(f"  {line}")
