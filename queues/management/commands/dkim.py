"""python manage.py dkim generate|list|record

dkim generate example.com --selector s1             # RSA 2048, rsa-sha256
dkim generate example.com --selector e1 --ed25519   # ed25519-sha256 (RFC 8463)
dkim list
dkim record example.com --selector s1               # the TXT record again

``generate`` writes the key into ``MAILRELAY_DKIM_KEYS_DIR`` as
``<domain>.<selector>.key`` (mode 0600) when that is set, else into the
database (``DkimKey``; ``--database`` chooses it anyway), and prints the DNS
TXT record to publish, in zone-file form, on standard output. The private
key is never printed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from queues import clock, dkim, domains
from queues.models import DkimKey


def zone_line(domain: str, selector: str, record: str) -> str:
    """``<selector>._domainkey.<domain>. IN TXT "…" "…"``: the record in
    character-strings of at most 255 octets (RFC 1035), which readers join."""
    pieces = [record[i : i + 255] for i in range(0, len(record), 255)]
    quoted = " ".join(f'"{piece}"' for piece in pieces)
    return f"{selector}._domainkey.{domain}. IN TXT {quoted}"


def _domain(value: str) -> str:
    try:
        domain = domains.domain_key(value)
    except domains.DomainError as exc:
        raise CommandError(f"{value!r} is not a domain ({exc})") from None
    if "." not in domain or domain.startswith("["):
        raise CommandError(f"{value!r} is not a domain name")
    return domain


def _selector(value: str) -> str:
    try:
        return dkim.check_selector(value)
    except dkim.DkimError as exc:
        raise CommandError(str(exc)) from None


def _write_key_file(folder: Path, domain: str, selector: str, key: bytes, force: bool) -> Path:
    if "." in selector:
        raise CommandError("a selector with dots cannot be a file name's: use --database")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / dkim.key_file_name(domain, selector)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)  # readable by the relay's user only
    except FileExistsError:
        raise CommandError(f"{path} exists (--force replaces it)") from None
    with os.fdopen(fd, "wb") as out:
        out.write(key)
    return path


class Command(BaseCommand):
    help = "DKIM keys: generate one (and print its DNS record), list them, print a record."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="command", required=True)
        p = sub.add_parser("generate", help="a new key; prints the TXT record to publish")
        p.add_argument("domain")
        p.add_argument("--selector", required=True)
        p.add_argument("--ed25519", action="store_true", help="ed25519-sha256 (default RSA)")
        p.add_argument("--database", action="store_true", help="keep it in the database")
        p.add_argument("--dir", help="folder for the key file (default MAILRELAY_DKIM_KEYS_DIR)")
        p.add_argument("--force", action="store_true", help="replace an existing key")
        p = sub.add_parser("list", help="the keys in the folder and the database")
        p.add_argument("--json", action="store_true")
        p = sub.add_parser("record", help="the TXT record of a key")
        p.add_argument("domain")
        p.add_argument("--selector", required=True)

    def handle(self, *args: Any, **options: Any) -> None:
        {"generate": self._generate, "list": self._list, "record": self._record}[
            options["command"]
        ](options)

    def _generate(self, options: dict[str, Any]) -> None:
        domain, selector = _domain(options["domain"]), _selector(options["selector"])
        algorithm = dkim.ED25519_SHA256 if options["ed25519"] else dkim.RSA_SHA256
        key = dkim.generate_private_key(algorithm)
        folder = options["dir"] or settings.MAILRELAY_DKIM_KEYS_DIR
        if folder and not options["database"]:
            where = str(_write_key_file(Path(folder), domain, selector, key, options["force"]))
        else:
            self._save_in_database(domain, selector, algorithm, key, options["force"])
            where = "the database"
        self.stderr.write(
            f"{algorithm} key {selector}._domainkey.{domain} written to {where}; "
            "publish this TXT record (the relay uses the key within "
            f"MAILRELAY_DKIM_KEY_REFRESH):"
        )
        self.stdout.write(zone_line(domain, selector, dkim.dns_record(key)))

    def _save_in_database(
        self, domain: str, selector: str, algorithm: str, key: bytes, force: bool
    ) -> None:
        values = {
            "algorithm": algorithm,
            "private_key": key.decode("ascii"),
            "enabled": True,
            "created_at": clock.now(),
        }
        if force:
            DkimKey.objects.update_or_create(domain=domain, selector=selector, defaults=values)
        elif DkimKey.objects.filter(domain=domain, selector=selector).exists():
            raise CommandError(f"{selector}._domainkey.{domain} exists (--force replaces it)")
        else:
            DkimKey.objects.create(domain=domain, selector=selector, **values)

    def _keys(self) -> list[dict[str, Any]]:
        """Every key found, marked with the one each domain signs with."""
        found = []
        folder = settings.MAILRELAY_DKIM_KEYS_DIR
        if folder:
            for path in sorted(Path(folder).glob(f"*{dkim.KEY_SUFFIX}")):
                key = dkim._file_key(path)
                if key is not None:
                    found.append((key, True))
        for row in DkimKey.objects.order_by("domain", "selector"):
            try:
                algorithm, private = dkim.normalize_private_key(row.private_key)
            except dkim.DkimError:
                continue
            key = dkim.SigningKey(
                row.domain, row.selector, algorithm, private, "database", row.created_at.timestamp()
            )
            found.append((key, row.enabled))
        in_use = dkim.load_keys(folder)
        return [
            {
                "domain": key.domain,
                "selector": key.selector,
                "algorithm": key.algorithm,
                "source": key.source,
                "enabled": enabled,
                "signing": in_use.get(key.domain) == key,
                "record": dkim.dns_record(key.private_key),
            }
            for key, enabled in found
        ]

    def _list(self, options: dict[str, Any]) -> None:
        keys = self._keys()
        if options["json"]:
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
        domain, selector = _domain(options["domain"]), _selector(options["selector"])
        for k in self._keys():
            if k["domain"] == domain and k["selector"] == selector:
                self.stdout.write(zone_line(domain, selector, k["record"]))
                return
        raise CommandError(f"no key {selector}._domainkey.{domain}")
