"""The client's MAIL/RCPT/DATA exchange on the wire, against a scripted peer.

The aiosmtpd sinks accept pipelined commands whether or not they offer
PIPELINING, so they cannot tell a pipelined exchange from a lock-step one.
This peer can: offering PIPELINING it withholds every reply until DATA has
arrived (a lock-step client would hang), and without it it checks that no
command is waiting unread when it answers one (a pipelining client would
be caught). It records the command lines and the bodies exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from delivery.smtp.client import deliver
from delivery.smtp.types import BatchResult, OutboundMessage
from tests.test_smtp_client import A, by_address, config, message, target

OK = b"250 2.0.0 OK\r\n"


@dataclass
class ScriptedPeer:
    pipelining: bool = True
    # Replies by verb ("MAIL", "DATA", "END" for the final dot) or by RCPT address.
    replies: dict[str, bytes] = field(default_factory=dict)
    lines: list[bytes] = field(default_factory=list)  # every command line received
    bodies: list[bytes] = field(default_factory=list)  # what came after 354, dot included
    # A command was waiting unread while a lock-step peer answered another.
    early: list[bytes] = field(default_factory=list)

    async def run(self, port: int, body: Callable[[], Awaitable[BatchResult]]) -> BatchResult:
        server = await asyncio.start_server(self._session, A, port)
        try:
            return await body()
        finally:
            server.close()
            await server.wait_closed()

    def _reply_to(self, line: bytes) -> bytes:
        verb = line[:4].upper().decode()
        if verb == "RCPT":
            address = line.split(b"<", 1)[1].split(b">", 1)[0].decode()
            return self.replies.get(address, OK)
        return self.replies.get(verb, b"354 go on\r\n" if verb == "DATA" else OK)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 peer.test ESMTP\r\n")
        pending: list[bytes] = []  # pipelined commands not answered yet
        try:
            while line := await reader.readline():
                verb = line[:4].upper()
                if verb == b"EHLO":
                    keywords = b"250-PIPELINING\r\n" if self.pipelining else b""
                    writer.write(b"250-peer.test\r\n" + keywords + b"250 8BITMIME\r\n")
                elif verb == b"QUIT":
                    writer.write(b"221 bye\r\n")
                    await writer.drain()
                    return
                elif verb in (b"MAIL", b"RCPT", b"DATA"):
                    self.lines.append(line)
                    pending.append(line)
                    if self.pipelining and verb != b"DATA":
                        continue  # answer the group once DATA is in
                    if not self.pipelining and reader._buffer:  # noqa: SLF001
                        self.early.append(line)
                    await self._answer(pending, reader, writer)
                else:  # RSET
                    self.lines.append(line)
                    writer.write(OK)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _answer(
        self, pending: list[bytes], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        for line in pending:
            reply = self._reply_to(line)
            writer.write(reply)
            if line.upper().startswith(b"DATA") and reply.startswith(b"354"):
                await writer.drain()
                self.bodies.append(await _read_body(reader))
                writer.write(self.replies.get("END", OK))
        pending.clear()


async def _read_body(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while line := await reader.readline():
        body += line
        if line == b".\r\n":
            return body
    raise ConnectionResetError("closed in the body")


def deliver_to(peer: ScriptedPeer, port: int, messages: list[OutboundMessage], **kw) -> BatchResult:
    async def body() -> BatchResult:
        return await deliver([target(A, port)], messages, config(max_connections=1), **kw)

    return asyncio.run(peer.run(port, body))


def verbs(peer: ScriptedPeer) -> list[str]:
    return [line[:4].decode().upper() for line in peer.lines]


def summary(batch: BatchResult, messages: list[OutboundMessage]) -> dict[str, tuple]:
    return {a: (r.outcome, r.phase, r.code) for a, r in by_address(batch, messages).items()}


# --- pipelined -------------------------------------------------------------------------


def test_pipelined_group_goes_out_before_any_reply(smtp_port):
    peer = ScriptedPeer(
        replies={"no@x.test": b"550 5.1.1 unknown\r\n", "later@x.test": b"450 busy\r\n"}
    )
    m = message("ok@x.test", "no@x.test", "later@x.test")
    batch = deliver_to(peer, smtp_port, [m])
    assert summary(batch, [m]) == {
        "ok@x.test": ("delivered", "data", 250),
        "no@x.test": ("failed", "rcpt", 550),
        "later@x.test": ("deferred", "rcpt", 450),
    }
    assert verbs(peer) == ["MAIL", "RCPT", "RCPT", "RCPT", "DATA"]
    assert peer.bodies == [m.data + b".\r\n"]


def test_pipelined_354_with_no_recipient_accepted_gets_a_lone_dot(smtp_port):
    # RFC 2920 §3.1: the peer should refuse DATA then; if it says 354 anyway
    # the client ends the empty transaction with the final dot alone.
    peer = ScriptedPeer(replies={"no@x.test": b"550 5.1.1 unknown\r\n"})
    first, second = message("no@x.test"), message("ok@x.test")
    batch = deliver_to(peer, smtp_port, [first, second])
    assert summary(batch, [first, second]) == {
        "no@x.test": ("failed", "rcpt", 550),
        "ok@x.test": ("delivered", "data", 250),
    }
    assert peer.bodies == [b".\r\n", second.data + b".\r\n"]
    # the final dot closed the transaction: no RSET before the next one
    assert verbs(peer) == ["MAIL", "RCPT", "DATA"] * 2


def test_pipelined_mail_refused_goes_to_every_recipient(smtp_port):
    peer = ScriptedPeer(
        replies={
            "MAIL": b"550 5.7.1 sender rejected\r\n",
            "a@x.test": b"503 5.5.1 need MAIL\r\n",
            "b@x.test": b"503 5.5.1 need MAIL\r\n",
            "DATA": b"503 5.5.1 need RCPT\r\n",
        }
    )
    m = message("a@x.test", "b@x.test")
    batch = deliver_to(peer, smtp_port, [m])
    # the 503s say nothing about the recipients: MAIL's reply is theirs
    assert summary(batch, [m]) == {
        "a@x.test": ("failed", "mail", 550),
        "b@x.test": ("failed", "mail", 550),
    }
    assert verbs(peer) == ["MAIL", "RCPT", "RCPT", "DATA"]
    assert peer.bodies == []


# --- lock-step -------------------------------------------------------------------------


def test_lock_step_waits_for_each_reply(smtp_port):
    peer = ScriptedPeer(pipelining=False, replies={"no@x.test": b"550 5.1.1 unknown\r\n"})
    messages = [message("ok@x.test", "no@x.test"), message("ok@x.test")]
    batch = deliver_to(peer, smtp_port, messages)
    assert [r.outcome for r in batch.results] == ["delivered", "failed", "delivered"]
    assert verbs(peer) == ["MAIL", "RCPT", "RCPT", "DATA", "MAIL", "RCPT", "DATA"]
    assert peer.early == []
    assert peer.bodies == [m.data + b".\r\n" for m in messages]


def test_lock_step_mail_refused_sends_no_rcpt_and_resets(smtp_port):
    peer = ScriptedPeer(pipelining=False, replies={"MAIL": b"451 4.3.0 try later\r\n"})
    m = message("a@x.test", "b@x.test")
    batch = deliver_to(peer, smtp_port, [m, message("c@x.test")])
    assert {r.outcome for r in batch.results} == {"deferred"}
    assert {r.phase for r in batch.results} == {"mail"}
    # MAIL refused each time; the open transaction is reset before the next one
    assert verbs(peer) == ["MAIL", "RSET", "MAIL"]
    assert peer.early == []


def test_lock_step_sends_no_data_without_an_accepted_recipient(smtp_port):
    peer = ScriptedPeer(pipelining=False, replies={"no@x.test": b"550 5.1.1 unknown\r\n"})
    first, second = message("no@x.test"), message("ok@x.test")
    batch = deliver_to(peer, smtp_port, [first, second])
    assert summary(batch, [first, second]) == {
        "no@x.test": ("failed", "rcpt", 550),
        "ok@x.test": ("delivered", "data", 250),
    }
    assert verbs(peer) == ["MAIL", "RCPT", "RSET", "MAIL", "RCPT", "DATA"]


# --- decided before the peer is asked ----------------------------------------------------


def test_unsafe_sender_is_refused_before_the_body_is_read(smtp_port):
    peer = ScriptedPeer()
    bad = message("a@x.test", mail_from="s@x.test\r\nRCPT TO:<evil@x.test>")
    good = message("b@x.test")
    bodies = {good.id: good.data}
    bad.data = good.data = None  # read through load_body only
    loaded: list[int] = []

    async def load_body(msg: OutboundMessage) -> bytes:
        loaded.append(msg.id)
        return bodies[msg.id]

    batch = deliver_to(peer, smtp_port, [bad, good], load_body=load_body)
    [refused] = [r for r in batch.results if r.message_id == bad.id]
    assert (refused.outcome, refused.phase, refused.code, refused.enhanced) == (
        "failed",
        "mail",
        None,
        "5.1.7",
    )
    assert loaded == [good.id]
    assert verbs(peer) == ["MAIL", "RCPT", "DATA"]
    assert b"evil" not in b"".join(peer.lines)
