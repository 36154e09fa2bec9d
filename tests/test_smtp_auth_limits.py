"""AUTH guessing limits on the wire (issue #20, item 5, and the AUTH small ones).

Real submission sessions (STARTTLS, then AUTH) against the in-process
ingress, real PostgreSQL, the counters in the real Redis (the test cache's
own key prefix, tests/support/ingress.py). Client addresses other than
127.0.0.1 are other loopback addresses (127.0.0.0/8 is all local on Linux).
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import smtplib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.contrib.auth.hashers import MD5PasswordHasher

from delivery.smtpd.authlimit import ADDRESS, USERNAME, AuthLimiter
from queues.models import Event
from queues.services import accounts
from tests.support.ingress import Ingress

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "correct horse battery staple"
HASH_SECONDS = 0.25


class SlowHasher(MD5PasswordHasher):
    """A hasher whose every run costs HASH_SECONDS, as a real one costs CPU: what a
    timing attacker measures, made large and certain."""

    algorithm = "slow_md5"

    def encode(self, password, salt):
        time.sleep(HASH_SECONDS)
        return super().encode(password, salt)

    def verify(self, password, encoded):
        time.sleep(HASH_SECONDS)
        return super().verify(password, encoded)


@pytest.fixture
def fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def submission(settings, tls_files, start_ingress, fast_hasher):
    """Start submission listeners (``start(**config)``) with one account, alice."""
    settings.MAILRELAY_RELAY_NETWORKS = [ipaddress.ip_network("192.0.2.0/24")]
    settings.MAILRELAY_ACCEPTED_DOMAINS = []
    accounts.create_account("alice", PASSWORD, allowed_senders=["example.org"])

    def start(**overrides: object) -> Ingress:
        return start_ingress(submission=True, **overrides)

    return start


def plain(username: str, password: str) -> str:
    return base64.b64encode(f"\0{username}\0{password}".encode()).decode()


def tls_session(ingress: Ingress, tls_files, source: str = "127.0.0.1") -> smtplib.SMTP:
    client = smtplib.SMTP(
        ingress.host,
        ingress.submission_port,
        "client.test",
        timeout=20,
        source_address=(source, 0),
    )
    client.ehlo()
    client.starttls(context=tls_files.client_context())
    client.ehlo()
    return client


def auth(client: smtplib.SMTP, username: str, password: str) -> tuple[int, bytes]:
    try:
        return client.docmd("AUTH", f"PLAIN {plain(username, password)}")
    except smtplib.SMTPServerDisconnected:
        return 0, b"closed"


def try_auth(ingress: Ingress, tls_files, username: str, password: str, source="127.0.0.1") -> int:
    """The reply code to AUTH in a new session; 421 if the connection itself is refused."""
    try:
        client = tls_session(ingress, tls_files, source)
    except smtplib.SMTPConnectError as refused:
        return refused.smtp_code
    with client:
        return auth(client, username, password)[0]


def close(client: smtplib.SMTP) -> None:
    try:
        client.quit()
    except (smtplib.SMTPException, OSError):
        client.close()


# --- item 5: the limit holds under parallel guesses, across processes, per account


def test_forty_parallel_guesses_get_no_more_than_the_limit(submission, tls_files):
    ingress = submission(max_auth_failures=5, max_auth_failures_per_user=0)
    guesses = 40
    sessions = [tls_session(ingress, tls_files) for _ in range(guesses)]
    barrier = threading.Barrier(guesses)

    def guess(n: int) -> int:
        barrier.wait()  # every session is in TLS, none refused yet: all AUTH at once
        return auth(sessions[n], "alice", f"guess {n}")[0]

    try:
        with ThreadPoolExecutor(guesses) as pool:
            codes = list(pool.map(guess, range(guesses)))
    finally:
        for client in sessions:
            close(client)
    assert codes.count(535) == 5, sorted(codes)  # five passwords checked, no more
    assert codes.count(421) == guesses - 5, sorted(codes)
    assert Event.objects.filter(kind="smtp_auth_failed").count() == 5


def test_two_ingress_processes_share_one_limit(submission, tls_files):
    first = submission(max_auth_failures=5, max_auth_failures_per_user=0)
    second = submission(max_auth_failures=5, max_auth_failures_per_user=0)
    codes = [try_auth(second if n % 2 else first, tls_files, "alice", f"g{n}") for n in range(6)]
    assert codes == [535] * 5 + [421]
    # A third process that saw none of it: the right password from that address is
    # refused too (the guesser learns nothing).
    third = submission(max_auth_failures=5, max_auth_failures_per_user=0)
    assert try_auth(third, tls_files, "alice", PASSWORD) == 421
    assert Event.objects.filter(kind="smtp_auth_failed").count() == 5


def test_an_account_is_limited_whatever_the_address(submission, tls_files):
    accounts.create_account("bob", PASSWORD)
    ingress = submission(max_auth_failures=5, max_auth_failures_per_user=3, junk_command_limit=5)
    replies = []
    for n in range(2, 7):  # one guess from each of five addresses
        with tls_session(ingress, tls_files, f"127.0.0.{n}") as client:
            replies.append(auth(client, "alice", f"guess {n}"))
    assert [code for code, _ in replies] == [535, 535, 535, 454, 454]
    assert replies[-1][1] == b"4.7.0 Too many authentication failures for this account, try later"
    with tls_session(ingress, tls_files, "127.0.0.9") as client:
        assert auth(client, "alice", PASSWORD)[0] == 454  # locked: the right password too
        assert auth(client, "bob", PASSWORD)[0] == 235  # the address is not
    # A refusal costs no hash; it counts as a junk command (EHLO twice, then three).
    with tls_session(ingress, tls_files, "127.0.0.10") as client:
        assert [auth(client, "alice", PASSWORD)[0] for _ in range(4)] == [454, 454, 454, 421]
    locked = Event.objects.filter(kind="smtp_auth_failed", data__locked_out=True)
    assert [e.data["locked"] for e in locked] == ["user name"]


def test_a_success_does_not_count_as_a_failure(submission, tls_files):
    ingress = submission(max_auth_failures=2, max_auth_failures_per_user=2)
    for _ in range(4):  # a client that logs in for every message
        with tls_session(ingress, tls_files) as client:
            assert auth(client, "alice", PASSWORD)[0] == 235
    with tls_session(ingress, tls_files) as client:
        assert auth(client, "alice", "typo")[0] == 535
    with tls_session(ingress, tls_files) as client:
        assert auth(client, "alice", PASSWORD)[0] == 235


def test_with_the_cache_down_auth_works_and_each_process_keeps_its_share(
    submission, tls_files, settings, caplog
):
    # Two runsmtp processes' worth: this one may count 4 // 2 = 2 failures itself.
    ingress = submission(max_auth_failures=4, max_auth_failures_per_user=0, processes=2)
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",  # nothing listens there
        }
    }
    with tls_session(ingress, tls_files) as client:
        assert auth(client, "alice", PASSWORD)[0] == 235
    codes = [try_auth(ingress, tls_files, "alice", f"guess {n}") for n in range(3)]
    assert codes == [535, 535, 421]
    assert "AUTH limits: cache unavailable" in caplog.text


def test_the_limiter_reserves_before_the_check(settings):
    limiter = AuthLimiter(per_address=2, per_user=0)
    limiter.forget(address="192.0.2.1")
    first = limiter.reserve("192.0.2.1", "x")
    second = limiter.reserve("192.0.2.1", "y")
    assert limiter.reserve("192.0.2.1", "z") == ADDRESS  # two in flight: the limit
    limiter.release(first)  # a success gives its place back
    assert limiter.failed(second) is None
    assert limiter.failed(limiter.reserve("192.0.2.1", "z")) == ADDRESS
    assert limiter.locked_out("192.0.2.1")  # learnt for the connection check
    limiter.forget(address="192.0.2.1")
    assert not limiter.locked_out("192.0.2.1")
    user = AuthLimiter(per_address=0, per_user=1)
    user.forget(username="carol")
    assert user.failed(user.reserve("192.0.2.2", "carol")) == USERNAME
    assert user.reserve("192.0.2.3", "carol") == USERNAME
    user.forget(username="carol")


# --- a disabled account costs what a wrong password costs, and never succeeds


def test_a_disabled_accounts_right_password_costs_a_full_hash(settings, submission, tls_files):
    ingress = submission()
    settings.PASSWORD_HASHERS = ["tests.test_smtp_auth_limits.SlowHasher"]
    accounts.set_password("alice", PASSWORD)
    with tls_session(ingress, tls_files) as client:
        assert auth(client, "alice", PASSWORD)[0] == 235  # now remembered as verified
    accounts.set_enabled("alice", False)
    timings = {}
    for password in (PASSWORD, "wrong"):
        with tls_session(ingress, tls_files) as client:
            started = time.monotonic()
            code, _ = auth(client, "alice", password)
            timings[password] = time.monotonic() - started
            assert code == 535
    assert timings[PASSWORD] >= HASH_SECONDS, timings  # not answered from the cache
    assert timings["wrong"] >= HASH_SECONDS, timings


# --- an over-long AUTH answer gets a clear reply, not a traceback


@pytest.mark.parametrize("mechanism", ["LOGIN", "PLAIN"])
def test_a_70_kb_auth_answer_gets_500_5_5_6(submission, tls_files, caplog, mechanism):
    ingress = submission()
    caplog.set_level(logging.INFO)
    with tls_session(ingress, tls_files) as client:
        code, _ = client.docmd("AUTH", mechanism)
        assert code == 334
        client.send(b"QUFB" * (70 * 1024 // 4) + b"\r\n")
        code, text = client.getreply()
        assert (code, text) == (500, b"5.5.6 Authentication Exchange line is too long")
        assert client.noop()[0] == 250  # the session goes on, in step
        assert auth(client, "alice", PASSWORD)[0] == 235
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert "AUTH answer too long" in caplog.text
