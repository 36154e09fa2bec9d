"""python manage.py dkim generate|list|record|disable|enable

dkim generate example.com --selector s1             # RSA 2048, rsa-sha256
dkim generate example.com --selector e1 --ed25519   # ed25519-sha256 (RFC 8463)
dkim list
dkim record example.com --selector s1               # the TXT record again
dkim disable example.com --selector s1              # a database key signs no more
dkim enable example.com --selector s1

``generate`` writes the key into ``MAILRELAY_DKIM_KEYS_DIR`` as
``<domain>.<selector>.key`` (mode 0600) when that is set, else into the
database (``DkimKey``; ``--database`` chooses it anyway), and prints the DNS
TXT record to publish, in zone-file form, on standard output. The private
key is never printed. The Queue Viewer's "DKIM keys" page does the same
(queues/services/dkim_keys.py).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from queues.management.commands.message import cli_actor
from queues.services import dkim_keys


class Command(BaseCommand):
    help = "DKIM keys: generate one (and print its DNS record), list, print a record, disable."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="command", required=True)
        p = sub.add_parser("generate", help="a new key; prints the TXT record to publish")
        p.add_argument("domain")
        p.add_argument("--selector", required=True)
        p.add_argument("--ed25519", action="store_true", help="ed25519-sha256 (default RSA)")
        p.add_argument("--database", action="store_true", help="keep it in the database")
        p.add_argument("--dir", help="folder for the key file (default MAILRELAY_DKIM_KEYS_DIR)")
        p.add_argument("--force", action="store_true", help="replace an existing key")
        p.add_argument("--user", help="the operator to record in the audit log")
        p = sub.add_parser("list", help="the keys in the folder and the database")
        p.add_argument("--json", action="store_true")
        p = sub.add_parser("record", help="the TXT record of a key")
        p.add_argument("domain")
        p.add_argument("--selector", required=True)
        for name, what in (("disable", "signs no more"), ("enable", "signs again")):
            p = sub.add_parser(name, help=f"a database key {what}")
            p.add_argument("domain")
            p.add_argument("--selector", required=True)
            p.add_argument("--user", help="the operator to record in the audit log")

    def handle(self, *args: Any, **options: Any) -> None:
        handler = {
            "generate": self._generate,
            "list": self._list,
            "record": self._record,
            "disable": self._set_enabled,
            "enable": self._set_enabled,
        }[options["command"]]
        try:
            handler(options)
        except dkim_keys.DkimKeyError as exc:
            raise CommandError(str(exc)) from None

    def _generate(self, options: dict[str, Any]) -> None:
        made = dkim_keys.generate(
            cli_actor(options),
            "cli",
            options["domain"],
            options["selector"],
            ed25519=options["ed25519"],
            folder=options["dir"],
            database=options["database"],
            force=options["force"],
        )
        self.stderr.write(
            f"{made.algorithm} key {made.selector}._domainkey.{made.domain} written to "
            f"{made.where}; publish this TXT record (the relay uses the key within "
            "MAILRELAY_DKIM_KEY_REFRESH):"
        )
        self.stdout.write(made.zone_line)

    def _list(self, options: dict[str, Any]) -> None:
        keys = dkim_keys.keys()
        if options["json"]:
            for k in keys:
                k.pop("zone_line")
            self.stdout.write(json.dumps(keys, indent=2))
            return
        if not keys:
            self.stdout.write("no DKIM keys")
            return
        for k in keys:
            state = "signing" if k["signing"] else ("enabled" if k["enabled"] else "disabled")
            self.stdout.write(
                f"{k['selector']}._domainkey.{k['domain']}  {k['algorithm']}  {state}  "
                f"{k['source']}"
            )

    def _record(self, options: dict[str, Any]) -> None:
        self.stdout.write(dkim_keys.find(options["domain"], options["selector"])["zone_line"])

    def _set_enabled(self, options: dict[str, Any]) -> None:
        enabled = options["command"] == "enable"
        changed = dkim_keys.set_enabled(
            cli_actor(options), "cli", options["domain"], options["selector"], enabled
        )
        word = "enabled" if enabled else "disabled"
        name = f"{options['selector']}._domainkey.{options['domain']}"
        self.stdout.write(f"{name} {word}" if changed else f"{name} was already {word}")
