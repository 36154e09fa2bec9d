"""DATABASE_URL in libpq's multi-host forms (issue #25): every process follows the primary.

A real ``runsmtp`` process is started with a DATABASE_URL that lists a host
that is down first and the test database's server second, in the URL and in
the key/value form; it must start, and a message sent to it must get 250
and be stored (libpq skipped the dead host).
"""

from __future__ import annotations

import re
import smtplib
import sys

import pytest
from django.db import connection

from queues.models import Message
from tests.support import processes
from tests.support.cluster import free_port

pytestmark = pytest.mark.django_db(transaction=True)


def _urls() -> dict[str, str]:
    db = connection.settings_dict
    host, port, name = db["HOST"] or "127.0.0.1", db["PORT"] or "5432", db["NAME"]
    user = db["USER"] or "postgres"
    dead = free_port()  # nothing listens there: a primary that is gone
    return {
        "url": f"postgres://{user}@127.0.0.1:{dead},{host}:{port}/{name}"
        "?target_session_attrs=read-write",
        "keyvalue": f"host=127.0.0.1,{host} port={dead},{port} dbname={name} user={user} "
        "target_session_attrs=read-write",
    }


@pytest.mark.parametrize("form", ["url", "keyvalue"])
def test_runsmtp_with_a_multi_host_database_url_stores_on_the_live_host(form: str) -> None:
    env = processes.test_env(
        DATABASE_URL=_urls()[form],
        MAILRELAY_SMTP_LISTEN="127.0.0.1:0",
        MAILRELAY_HOSTNAME="relay.test",
    )
    proc = processes.Proc("runsmtp", [sys.executable, "manage.py", "runsmtp"], env)
    try:
        proc.wait_for("listening on 127.0.0.1:")
        port = next(
            int(m.group(1))
            for line in proc.lines
            if (m := re.search(r"listening on 127\.0\.0\.1:(\d+)$", line))
        )
        with smtplib.SMTP("127.0.0.1", port, timeout=20) as client:
            client.ehlo("client.test")
            client.mail("a@example.org")
            client.rcpt("b@example.net")
            code, text = client.data(f"Subject: multi-host {form}\r\n\r\nbody\r\n".encode())
        assert code == 250, text
        assert Message.objects.filter(subject=f"multi-host {form}").count() == 1
    finally:
        proc.stop()
