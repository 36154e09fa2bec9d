"""AUTH (RFC 4954; PLAIN RFC 4616, LOGIN): the AUTH command of an inbound session.

``AuthCommand`` is a part of ``session.InboundSMTP`` (one of its bases): the
command, its 334 challenges read from the connection, the PLAIN and LOGIN
responses decoded, and the credentials checked in a database thread. How
many guesses an address or a username gets is ``authlimit``'s; the account
and its password hash are ``queues.services.accounts``'. AUTH is offered
inside TLS only (``commands.Commands.smtp_EHLO`` advertises it there). What
an authenticated account's message may name as its author is checked at its
end (``header_sender_refusal``, called by ``server.RelayHandler``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from typing import TYPE_CHECKING

from aiosmtpd.smtp import syntax

from delivery.smtpd import authlimit, policy
from queues.accept import printable
from queues.lib import author_addresses
from queues.services import accounts

if TYPE_CHECKING:
    from delivery.smtpd.state import SessionState as _Session
else:
    _Session = object  # at run time the state and replies are the session's own

log = logging.getLogger(__name__)

AUTH_MECHANISMS = ("PLAIN", "LOGIN")


def decode_base64(text: str) -> bytes | None:
    """An AUTH response ("=" is the empty one, RFC 4954 4), or None if not base64."""
    text = text.strip()
    if text == "=":
        return b""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return None


def plain_credentials(response: bytes) -> tuple[str, str] | None:
    """(username, password) from a PLAIN response (RFC 4616), or None if malformed.

    An authorization identity other than the user's own is refused later (as
    a wrong password): mailrelay has no proxy authorization.
    """
    parts = response.split(b"\x00")
    if len(parts) != 3:
        return None
    authzid, authcid, password = (part.decode("utf-8", "replace") for part in parts)
    if authzid and authzid != authcid:
        return authcid, ""  # never matches: no account has an empty password
    return authcid, password


class AuthCommand(_Session):
    """The AUTH command of ``session.InboundSMTP`` (a base of it, not a session alone).

    What it uses of the session (its replies, its reader, its state and its
    server) is declared in ``state.SessionState``.
    """

    @syntax("AUTH <mechanism> [initial-response]")
    async def smtp_AUTH(self, arg: str | None) -> None:
        if await self.check_helo_needed("EHLO"):
            return
        assert self.session is not None
        refusal = self._auth_refusal()
        if refusal is not None:
            if refusal == policy.AUTH_LOCKED_OUT:
                self._goodbye(refusal)
            else:
                await self.push(refusal)
            return
        words = (arg or "").split()
        if not 1 <= len(words) <= 2:
            await self.push(policy.AUTH_SYNTAX)
            return
        mechanism = words[0].upper()
        if mechanism not in AUTH_MECHANISMS:
            await self.push(policy.AUTH_MECHANISM)
            return
        initial = words[1] if len(words) == 2 else None
        if mechanism == "PLAIN":
            credentials = await self._plain(initial)
        else:
            credentials = await self._login(initial)
        if credentials is None:
            return  # the reply (501) was sent
        await self._check_credentials(mechanism, *credentials)

    def _auth_refusal(self) -> str | None:
        assert self.session is not None
        if not self.session.extended_smtp:
            return policy.AUTH_NEEDS_EHLO
        if not self.tls_active:
            return policy.AUTH_NEEDS_TLS
        if self.server.auth_limiter.locked_out(policy.client_key(self.client_ip)):
            return policy.AUTH_LOCKED_OUT
        if self.grant is not None:
            return policy.AUTH_ALREADY
        if getattr(self.envelope, "started", False):  # a RelayEnvelope after MAIL
            return policy.AUTH_IN_TRANSACTION
        return None

    async def _challenge(self, prompt: bytes) -> bytes | None:
        """Send a 334 challenge and read the client's base64 answer; None (and 501) if
        it aborts with "*" or is not base64. The answer is never logged."""
        await self.push("334 " + base64.b64encode(prompt).decode("ascii"))
        line = await self._answer_line()
        self.restart_idle_timer()
        if line is None:
            log.warning("%s: AUTH answer too long; refused", self.client_ip)
            await self.push(policy.AUTH_LINE_TOO_LONG)
            return None
        answer = line.strip()
        if answer == b"*":
            await self.push(policy.AUTH_ABORTED)
            return None
        return await self._decoded(answer.decode("ascii", "replace"))

    async def _answer_line(self) -> bytes | None:
        """The client's answer to a 334, to its LF; None when it is longer than the
        reader's limit (64 KiB): then it is read to its end and dropped, in step."""
        reader = self.reader
        too_long = False
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError as exc:
                await reader.read(exc.consumed)  # bytes that hold no LF: dropped
                too_long = True
                continue
            except asyncio.IncompleteReadError:
                raise asyncio.CancelledError() from None  # the client went away mid-AUTH
            return None if too_long else line

    async def _decoded(self, text: str) -> bytes | None:
        """``text`` decoded from base64; None (and 501) when it is not base64."""
        decoded = decode_base64(text)
        if decoded is None:
            await self.push(policy.AUTH_BAD_BASE64)
        return decoded

    async def _first_response(self, initial: str | None, prompt: bytes):
        """The client's first answer: given with AUTH (RFC 4954 initial response)
        or asked for with ``prompt``; None after a bad or aborted answer."""
        if initial is None:
            return await self._challenge(prompt)
        return await self._decoded(initial)

    async def _plain(self, initial: str | None) -> tuple[str, str] | None:
        response = await self._first_response(initial, b"")
        if response is None:
            return None
        credentials = plain_credentials(response)
        if credentials is None:
            await self.push(policy.AUTH_BAD_PLAIN)
        return credentials

    async def _login(self, initial: str | None) -> tuple[str, str] | None:
        username = await self._first_response(initial, b"Username:")
        if username is None:
            return None
        password = await self._challenge(b"Password:")
        if password is None:
            return None
        return username.decode("utf-8", "replace"), password.decode("utf-8", "replace")

    async def _check_credentials(self, mechanism: str, username: str, password: str) -> None:
        """Reserve the attempt, check the hash (a database thread: it costs
        milliseconds), then 235, 535, or the lockout (``authlimit``)."""
        try:
            outcome = await self.server.in_database(
                authlimit.attempt,
                self.server.auth_limiter,
                policy.client_key(self.client_ip),
                username,
                password,
            )
        except Exception:
            log.exception("%s: AUTH could not be checked", self.client_ip)
            await self.push(policy.AUTH_UNAVAILABLE)
            return
        del password
        assert isinstance(outcome, authlimit.Outcome)
        if outcome.refused == authlimit.ADDRESS:
            log.warning("%s: AUTH refused: too many failures from this address", self.client_ip)
            self._goodbye(policy.AUTH_LOCKED_OUT)
            return
        if outcome.refused == authlimit.USERNAME:
            log.warning(
                "%s: AUTH refused for %r: too many failures", self.client_ip, username[:150]
            )
            if not self.count_junk():  # costs no hash: bounded as junk commands are
                await self.push(policy.AUTH_ACCOUNT_LOCKED)
            return
        if outcome.grant is not None:
            self.grant = outcome.grant
            log.info("%s: authenticated as %s (%s)", self.client_ip, username, mechanism)
            await self.push(policy.AUTH_OK)
            return
        log.warning("%s: AUTH %s failed for %r", self.client_ip, mechanism, username[:150])
        client = str(self.client_ip) if self.client_ip else None
        try:
            await self.server.in_database(
                accounts.record_auth_failure,
                client,
                username,
                mechanism,
                locked_out=outcome.locked is not None,
                locked=outcome.locked or authlimit.ADDRESS,
            )
        except Exception:  # noqa: BLE001 - the reply matters more than the event
            log.warning("could not record an AUTH failure event", exc_info=True)
        await self.push(policy.AUTH_FAILED)


def header_sender_refusal(grant: accounts.Grant, data: bytes | bytearray) -> str | None:
    """550 5.7.1 when a From or Sender address of the header is not one the
    account may use (as MAIL FROM is checked): signed, it would pass DKIM and
    DMARC as that address's domain. None when every one is allowed."""
    for field, address in author_addresses(data):
        if not grant.may_send_as(address):
            return policy.HEADER_SENDER_NOT_ALLOWED.format(
                address=printable(address)[:300], field=field, username=grant.username
            )
    return None
