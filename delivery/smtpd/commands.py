"""The commands of an inbound session before DATA: HELO/EHLO, MAIL, RCPT, VRFY,
and the budget of commands that move no message (smtpd_junk_command_limit).

``Commands`` is a part of ``session.InboundSMTP`` (one of its bases, as
``auth.AuthCommand`` is): the greeting's replies, the envelope built from
MAIL and RCPT (their arguments parsed and judged by ``policy``; an
authenticated sender checked against its account; back pressure asked at
MAIL), and the junk budget that AUTH's refusals count against too. DATA,
the connection and the replies are ``session``'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from aiosmtpd.smtp import SMTP, syntax

from delivery.smtpd import policy
from delivery.smtpd.auth import AUTH_MECHANISMS
from delivery.smtpd.config import SMTP_LISTENER, SUBMISSION
from queues.accept import IncomingRecipient
from queues.services import accounts

if TYPE_CHECKING:
    from delivery.smtpd.state import SessionState as _Session
else:
    _Session = object  # at run time the state and replies are the session's own

log = logging.getLogger(__name__)


def junk_command(
    method: Callable[[Commands, str | None], Awaitable[None]],
) -> Callable[[Commands, str | None], Awaitable[None]]:
    """Count a command that does not advance a transaction (smtpd_junk_command_limit)."""

    @functools.wraps(method)  # keeps aiosmtpd's @syntax attributes (HELP text)
    async def counted(self: Commands, arg: str | None) -> None:
        if self.count_junk():
            return
        await method(self, arg)

    return counted


class Commands(_Session):
    """HELO/EHLO, MAIL, RCPT, VRFY and the junk budget of ``session.InboundSMTP``
    (a base of it, not a session alone).

    What it uses of the session (its replies, its state, its idle timer and
    its server) is declared in ``state.SessionState``.
    """

    def count_junk(self) -> bool:
        """One more command that moves no message; True (and 421, closed) past the limit."""
        self.junk_commands += 1
        limit = self.config.junk_command_limit
        if limit and self.junk_commands > limit:
            log.info("%s: more than %d junk commands; closing", self.client_ip, limit)
            self._goodbye(policy.TOO_MANY_JUNK_COMMANDS)
            return True
        return False

    async def bad_command(self, reply: str) -> None:
        """A malformed MAIL or RCPT: its error reply, but it counts toward the junk
        command limit like a command that moves no message (421 and closed past it)."""
        if not self.count_junk():
            await self.push(reply)

    # Commands that do not advance a transaction (Postfix counts the same ones).
    smtp_NOOP = junk_command(SMTP.smtp_NOOP)
    smtp_RSET = junk_command(SMTP.smtp_RSET)
    smtp_HELP = junk_command(SMTP.smtp_HELP)
    smtp_EXPN = junk_command(SMTP.smtp_EXPN)

    async def _push_lines(self, lines: Sequence[str]) -> None:
        """A reply written as given (HELO/EHLO replies carry no enhanced codes)."""
        self.write_raw("".join(line + "\r\n" for line in lines).encode("utf-8", "replace"))
        await self.drain_writes()

    @junk_command
    @syntax("HELO hostname")
    async def smtp_HELO(self, hostname: str | None) -> None:
        if not hostname:
            await self._push_lines([policy.HELO_SYNTAX])
            return
        self.reset_transaction()
        assert self.session is not None
        self.session.extended_smtp = False
        self.session.host_name = hostname
        await self._push_lines([f"250 {self.hostname}"])

    @junk_command
    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str | None) -> None:
        if not hostname:
            await self._push_lines([policy.EHLO_SYNTAX])
            return
        self.reset_transaction()
        assert self.session is not None
        self.session.extended_smtp = True
        self.session.host_name = hostname
        size = self.config.max_message_size
        lines = [
            self.hostname,
            "PIPELINING",
            f"SIZE {size}" if size else "SIZE",
            "8BITMIME",
            "SMTPUTF8",
            "ENHANCEDSTATUSCODES",
            "DSN",
        ]
        if self.tls_context and not self.tls_active:  # not offered again inside TLS
            lines.append("STARTTLS")
        if self.tls_active:  # never advertised in cleartext (RFC 4954 4; RFC 8314)
            lines.append("AUTH " + " ".join(AUTH_MECHANISMS))
        await self._push_lines([f"250-{line}" for line in lines[:-1]] + [f"250 {lines[-1]}"])

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        assert self.session is not None
        envelope = self.envelope
        if envelope.started:
            await self.push(policy.NESTED_MAIL)
            return
        if self.kind == SUBMISSION and not self.tls_active:
            await self.push(policy.STARTTLS_FIRST)
            return
        if self.kind != SMTP_LISTENER and self.grant is None:
            await self.push(policy.AUTH_REQUIRED)  # RFC 6409 4.1: submission needs AUTH
            return
        rest = policy.command_argument("FROM:", arg or "")
        if rest is None:
            await self.bad_command(policy.MAIL_SYNTAX)
            return
        try:
            sender, params = policy.parse_mail(
                rest, extended=self.session.extended_smtp, max_size=self.config.max_message_size
            )
        except policy.Refused as refused:
            await self.bad_command(refused.reply)
            return
        if self.grant is not None:
            refusal = await self._account_refusal(self.grant, sender.address if sender else "")
            if refusal is not None:
                await self.push(refusal)
                return
        monitor = self.server.monitor
        if monitor is not None:
            decision = monitor.mail_from_decision(self.may_relay)
            if decision.refuse_reply is not None:
                log.debug("back pressure: refused MAIL FROM of %s", self.client_ip)
                await self.push(decision.refuse_reply)
                return
            if decision.delay_seconds > 0:
                # Tarpit: only this session waits; aiosmtpd cancels the sleep
                # if the client goes away, and stop() says 421 meanwhile.
                await asyncio.sleep(decision.delay_seconds)
                self.restart_idle_timer()
        envelope.started = True
        envelope.mail_from = sender.address if sender else ""
        envelope.params = params
        envelope.smtp_utf8 = params.smtputf8
        await self.push(policy.SENDER_OK)

    @syntax("RCPT TO: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        assert self.session is not None
        envelope = self.envelope
        if not envelope.started:
            await self.push(policy.NEED_MAIL)
            return
        rest = policy.command_argument("TO:", arg or "")
        if rest is None:
            await self.bad_command(policy.RCPT_SYNTAX)
            return
        try:
            recipient, params = policy.parse_rcpt(
                rest, extended=self.session.extended_smtp, utf8=envelope.params.smtputf8
            )
        except policy.Refused as refused:
            await self.bad_command(refused.reply)
            return
        refusal = policy.recipient_refusal(
            recipient, trusted=self.may_relay, accepted_domains=self.config.accepted_domains
        )
        if refusal is not None:
            log.info("refused <%s> from %s: %s", recipient.address, self.client_ip, refusal)
            await self.push(refusal)
            return
        if len(envelope.recipients) >= self.config.max_recipients:
            await self.push(policy.TOO_MANY_RECIPIENTS)
            return
        envelope.recipients.append(
            IncomingRecipient(recipient.address, orcpt=params.orcpt, notify=params.notify)
        )
        envelope.rcpt_tos.append(recipient.address)
        await self.push(policy.RECIPIENT_OK)

    async def _account_refusal(self, grant: accounts.Grant, address: str) -> str | None:
        """The reply refusing an authenticated MAIL FROM, or None: its sender, its rate."""
        if not grant.may_send_as(address):
            log.info("%s: account %s may not send as <%s>", self.client_ip, grant.username, address)
            return policy.SENDER_NOT_ALLOWED.format(address=address, username=grant.username)
        if grant.max_messages_per_hour:
            try:
                limited = await self.server.in_database(accounts.rate_limited, grant)
            except Exception:
                log.exception("could not check the rate of account %s", grant.username)
                return policy.INTERNAL_ERROR
            if limited:
                log.info("%s: account %s over its rate", self.client_ip, grant.username)
                return policy.ACCOUNT_RATE_LIMITED.format(
                    username=grant.username, limit=grant.max_messages_per_hour
                )
        return None

    @junk_command
    @syntax("VRFY <address>")
    async def smtp_VRFY(self, arg: str | None) -> None:
        # Answer without looking anything up: a relay has no mailboxes to verify.
        await self.push(policy.CANNOT_VRFY if arg else policy.VRFY_SYNTAX)
