"""`python manage.py smtpaccount add|list|passwd|disable|enable|delete`: SMTP AUTH accounts.

Passwords are read from the terminal (asked twice) or, when stdin is not a
terminal, from its first line (``echo "$PW" | manage.py smtpaccount passwd
alice``): never from the command line, where ``ps`` would show them. Every
change is in the audit log with via="cli".
"""

from __future__ import annotations

import getpass
import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from queues.management.commands.message import add_actor_option, cli_actor
from queues.services import accounts


def read_password(stdin=None) -> str:
    stdin = stdin or sys.stdin
    if not stdin.isatty():
        return stdin.readline().rstrip("\r\n")
    first = getpass.getpass("Password: ")
    if first != getpass.getpass("Password (again): "):
        raise CommandError("the passwords do not match")
    return first


class Command(BaseCommand):
    help = "Manage the SMTP accounts that may relay with AUTH on the submission ports."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="subcommand", required=True)
        add = sub.add_parser("add", help="add an account (the password is asked for)")
        add.add_argument("username")
        add.add_argument(
            "--sender",
            action="append",
            default=[],
            help="an address or domain it may use as MAIL FROM (repeat for more)",
        )
        add.add_argument("--rate", type=int, help="at most this many messages per hour")
        add.add_argument("--disabled", action="store_true", help="add it disabled")
        add_actor_option(add)
        listing = sub.add_parser("list", help="list the accounts (never their passwords)")
        listing.add_argument("--json", action="store_true", help="one JSON document")
        for name, text in (
            ("passwd", "set a new password (asked for)"),
            ("disable", "refuse its AUTH from now on"),
            ("enable", "allow its AUTH again"),
            ("delete", "remove the account"),
        ):
            cmd = sub.add_parser(name, help=text)
            cmd.add_argument("username")
            add_actor_option(cmd)
        change = sub.add_parser("set", help="change its senders or rate")
        change.add_argument("username")
        change.add_argument("--sender", action="append", help="replaces the allowed senders")
        change.add_argument("--rate", type=int, help="messages per hour; 0 = no limit")
        add_actor_option(change)

    def handle(self, *args: Any, subcommand: str, **options: Any) -> None:
        try:
            getattr(self, "_" + subcommand)(options)
        except accounts.AccountError as exc:
            raise CommandError(str(exc)) from None

    def _add(self, options: dict[str, Any]) -> None:
        account = accounts.create_account(
            options["username"],
            read_password(),
            allowed_senders=options["sender"],
            max_messages_per_hour=options["rate"],
            enabled=not options["disabled"],
        )
        accounts.audit(cli_actor(options), "cli", "add", account.username)
        self.stdout.write(f"added {account.username}")

    def _list(self, options: dict[str, Any]) -> None:
        rows = [accounts.account_summary(a) for a in accounts.list_accounts()]
        if options["json"]:
            self.stdout.write(json.dumps(rows, indent=2))
            return
        for row in rows:
            rate = row["max_messages_per_hour"] or "-"
            state = "enabled" if row["enabled"] else "disabled"
            senders = ",".join(row["allowed_senders"]) or "-"
            last = row["last_login_at"] or "never"
            self.stdout.write(f"{row['username']}\t{state}\t{senders}\trate={rate}\tlast={last}")

    def _passwd(self, options: dict[str, Any]) -> None:
        accounts.get_account(options["username"])  # unknown: fail before asking
        accounts.set_password(options["username"], read_password())
        accounts.audit(cli_actor(options), "cli", "passwd", options["username"])
        self.stdout.write(f"password of {options['username']} changed")

    def _disable(self, options: dict[str, Any]) -> None:
        accounts.set_enabled(options["username"], False)
        accounts.audit(cli_actor(options), "cli", "disable", options["username"])
        self.stdout.write(f"disabled {options['username']}")

    def _enable(self, options: dict[str, Any]) -> None:
        accounts.set_enabled(options["username"], True)
        accounts.audit(cli_actor(options), "cli", "enable", options["username"])
        self.stdout.write(f"enabled {options['username']}")

    def _delete(self, options: dict[str, Any]) -> None:
        accounts.delete_account(options["username"])
        accounts.audit(cli_actor(options), "cli", "delete", options["username"])
        self.stdout.write(f"deleted {options['username']}")

    def _set(self, options: dict[str, Any]) -> None:
        rate = options["rate"]
        accounts.update_account(
            options["username"],
            allowed_senders=options["sender"],
            max_messages_per_hour=False if rate is None else rate,
        )
        accounts.audit(cli_actor(options), "cli", "change", options["username"])
        self.stdout.write(f"changed {options['username']}")
