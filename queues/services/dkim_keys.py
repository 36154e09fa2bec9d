"""DKIM keys as an operator manages them: list, generate, the DNS record to
publish, disable and enable. The one implementation behind ``manage.py dkim``
and the Queue Viewer's "DKIM keys" page (admin role); signing itself is
queues.dkim's.

A key lives in ``MAILRELAY_DKIM_KEYS_DIR`` (a file ``<domain>.<selector>.key``)
or in the database (``DkimKey``). Only a database key can be disabled here: a
file key is retired by removing its file. Every change is an audit entry
(``dkim_generate``, ``dkim_disable``, ``dkim_enable``); a private key is never
shown, logged or audited.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queues import accept, dkim, lib
from queues.config import store_settings
from queues.lib import clock
from queues.models import DkimKey


class DkimKeyError(dkim.DkimError):
    """A request about keys that cannot be done (a command error, a message on the page)."""


@dataclass(frozen=True)
class Generated:
    domain: str
    selector: str
    algorithm: str
    where: str  # a file's path, or "the database"
    zone_line: str  # the TXT record to publish, in zone-file form


def zone_line(domain: str, selector: str, record: str) -> str:
    """``<selector>._domainkey.<domain>. IN TXT "…" "…"``: the record in
    character-strings of at most 255 octets (RFC 1035), which readers join."""
    pieces = [record[i : i + 255] for i in range(0, len(record), 255)]
    quoted = " ".join(f'"{piece}"' for piece in pieces)
    return f"{selector}._domainkey.{domain}. IN TXT {quoted}"


def clean_domain(value: str) -> str:
    try:
        domain = lib.domain_key(value)
    except lib.DomainError as exc:
        raise DkimKeyError(f"{value!r} is not a domain ({exc})") from None
    if "." not in domain or domain.startswith("["):
        raise DkimKeyError(f"{value!r} is not a domain name")
    return domain


def clean_selector(value: str) -> str:
    try:
        return dkim.check_selector(value)
    except dkim.DkimError as exc:
        raise DkimKeyError(str(exc)) from None


def _write_key_file(folder: Path, domain: str, selector: str, key: bytes, force: bool) -> Path:
    if "." in selector:
        raise DkimKeyError("a selector with dots cannot be a file name's: keep it in the database")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / dkim.key_file_name(domain, selector)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)  # readable by the relay's user only
    except FileExistsError:
        raise DkimKeyError(f"{path} exists (--force replaces it)") from None
    with os.fdopen(fd, "wb") as out:
        out.write(key)
    return path


def _save_in_database(domain: str, selector: str, algorithm: str, key: bytes, force: bool) -> None:
    values = {
        "algorithm": algorithm,
        "private_key": key.decode("ascii"),
        "enabled": True,
        "created_at": clock.now(),
    }
    if force:
        DkimKey.objects.update_or_create(domain=domain, selector=selector, defaults=values)
    elif DkimKey.objects.filter(domain=domain, selector=selector).exists():
        raise DkimKeyError(f"{selector}._domainkey.{domain} exists (--force replaces it)")
    else:
        DkimKey.objects.create(domain=domain, selector=selector, **values)


def generate(
    actor: Any,
    via: str,
    domain: str,
    selector: str,
    *,
    ed25519: bool = False,
    folder: str | None = None,
    database: bool = False,
    force: bool = False,
) -> Generated:
    """A new key for ``domain`` / ``selector``: into ``folder`` (default
    ``MAILRELAY_DKIM_KEYS_DIR``) when there is one and not ``database``, else
    into the database. The relay signs with it within MAILRELAY_DKIM_KEY_REFRESH."""
    domain, selector = clean_domain(domain), clean_selector(selector)
    algorithm = dkim.ED25519_SHA256 if ed25519 else dkim.RSA_SHA256
    key = dkim.generate_private_key(algorithm)
    folder = folder if folder is not None else store_settings().dkim_keys_dir
    if folder and not database:
        where = str(_write_key_file(Path(folder), domain, selector, key, force))
    else:
        _save_in_database(domain, selector, algorithm, key, force)
        where = "the database"
    accept.reset_key_store()  # this process signs with it at once
    _audit(actor, via, "generate", domain, selector, f"{algorithm}, in {where}")
    return Generated(
        domain, selector, algorithm, where, zone_line(domain, selector, dkim.dns_record(key))
    )


def keys() -> list[dict[str, Any]]:
    """Every key found (files, then the database), marked with the one each
    domain signs with; ``record``: its TXT record's text."""
    found = []
    folder = store_settings().dkim_keys_dir
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
    out = []
    for key, enabled in found:
        record = dkim.dns_record(key.private_key)
        out.append(
            {
                "domain": key.domain,
                "selector": key.selector,
                "algorithm": key.algorithm,
                "source": key.source,
                "enabled": enabled,
                "signing": in_use.get(key.domain) == key,
                "record": record,
                "zone_line": zone_line(key.domain, key.selector, record),
            }
        )
    return out


def find(domain: str, selector: str) -> dict[str, Any]:
    domain, selector = clean_domain(domain), clean_selector(selector)
    for k in keys():
        if k["domain"] == domain and k["selector"] == selector:
            return k
    raise DkimKeyError(f"no key {selector}._domainkey.{domain}")


def set_enabled(actor: Any, via: str, domain: str, selector: str, enabled: bool) -> bool:
    """Disable (or enable again) a database key; False when it already was so.
    A disabled key signs nothing; another key of the domain may take over."""
    domain, selector = clean_domain(domain), clean_selector(selector)
    row = DkimKey.objects.filter(domain=domain, selector=selector).first()
    if row is None:
        if any(k["domain"] == domain and k["selector"] == selector for k in keys()):
            raise DkimKeyError(
                f"{selector}._domainkey.{domain} is a key file in MAILRELAY_DKIM_KEYS_DIR: "
                "remove the file to retire it"
            )
        raise DkimKeyError(f"no key {selector}._domainkey.{domain}")
    if row.enabled == enabled:
        return False
    DkimKey.objects.filter(pk=row.pk).update(enabled=enabled)
    accept.reset_key_store()
    _audit(actor, via, "enable" if enabled else "disable", domain, selector)
    return True


def _audit(actor: Any, via: str, action: str, domain: str, selector: str, detail: str = "") -> None:
    from queues.services.actions import _audit as write  # the one writer of AuditEntry rows

    name = f"{selector}._domainkey.{domain}"
    write(
        actor,
        via,
        f"dkim_{action}",
        "dkim_key",
        count=1,
        detail=f"{name}: {detail}" if detail else name,
    )
