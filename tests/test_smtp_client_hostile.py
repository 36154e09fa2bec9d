"""The outbound SMTP client against hostile peers, a lost round and bodies
read just in time: real sockets on loopback (an asyncio SMTP peer written
here, or the aiosmtpd sinks of ``tests.support.sinks``)."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from delivery.smtp.client import deliver
from delivery.smtp.connection import (
    MAX_REPLY_BYTES,
    MAX_REPLY_LINES,
    READ_LIMIT,
    ClientConfig,
    Connection,
    ProtocolError,
)
from delivery.smtp.types import BatchResult, OutboundMessage
from tests.test_smtp_client import A, B, config, message, target

MiB = 1024 * 1024

# --- a hostile peer -------------------------------------------------------------------

# What a flood sends, forever, once it starts.
FLOODS: dict[str, bytes] = {
    # endless continuation lines, each short: the line cap trips first
    "lines": b"250-" + b"x" * 60 + b"\r\n",
    # endless continuation lines of 1,000 bytes: the byte cap trips first
    "long-lines": b"250-" + b"y" * 1000 + b"\r\n",
    # one line that never ends: READ_LIMIT trips
    "no-newline": b"z" * 4096,
}
CAP_TEXT = {
    "lines": f"reply longer than {MAX_REPLY_LINES} lines",
    "long-lines": f"reply longer than {MAX_REPLY_BYTES} bytes",
    "no-newline": f"reply line longer than {READ_LIMIT} bytes",
}


@dataclass
class Peer:
    """A scripted SMTP peer in the test's own event loop.

    ``flood_at`` is where it starts flooding instead of replying: "greeting",
    "EHLO" or "end of data" (after taking a message); "" never floods and
    behaves as a plain, lock-step SMTP server that discards what it gets.
    """

    flood_at: str = ""
    flood: str = "lines"
    connections: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    bodies: list[int] = field(default_factory=list)  # sizes of the messages received
    server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> Peer:
        self.server = await asyncio.start_server(self._session, host, port)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _flood(self, writer: asyncio.StreamWriter, first: bytes = b"") -> None:
        pattern = FLOODS[self.flood]
        block = pattern * (64 * 1024 // len(pattern))  # ~64 KiB per write
        if first:
            writer.write(first)
        while True:  # until the client hangs up
            writer.write(block)
            await writer.drain()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._converse(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.closed.set()

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A flood of "no-newline" must start inside a reply line.
        lead = b"250-" if self.flood == "no-newline" else b""
        if self.flood_at == "greeting":
            return await self._flood(writer, lead.replace(b"250", b"220"))
        writer.write(b"220 peer.test ESMTP\r\n")
        while line := await reader.readline():
            verb = line[:4].upper()
            if verb in (b"EHLO", b"HELO"):
                if self.flood_at == "EHLO":
                    return await self._flood(writer, b"250-peer.test\r\n" + lead)
                writer.write(b"250-peer.test\r\n250 8BITMIME\r\n")
            elif verb == b"DATA":
                writer.write(b"354 go on\r\n")
                await writer.drain()
                self.bodies.append(await self._discard_body(reader))
                if self.flood_at == "end of data":
                    return await self._flood(writer, lead)
                writer.write(b"250 2.0.0 taken\r\n")
            elif verb == b"QUIT":
                writer.write(b"221 bye\r\n")
                await writer.drain()
                return
            else:
                writer.write(b"250 OK\r\n")
            await writer.drain()

    @staticmethod
    async def _discard_body(reader: asyncio.StreamReader) -> int:
        """Read up to the final dot, keeping nothing but a short tail."""
        size, tail = 0, b"\r\n"
        while True:
            chunk = await reader.read(256 * 1024)
            if not chunk:
                raise ConnectionResetError
            size += len(chunk)
            tail = (tail + chunk)[-5:]
            if tail == b"\r\n.\r\n":
                return size


async def with_peer(
    port: int, peer: Peer, body: Callable[[], Awaitable[BatchResult]], host: str = A
) -> BatchResult:
    await peer.start(host, port)
    try:
        return await body()
    finally:
        await peer.stop()


def hostile_config(**kw) -> ClientConfig:
    # Generous timeouts: the caps, not a timeout, must end the session.
    return config(command_timeout=30.0, data_timeout=30.0, **kw)


# --- bounded replies ------------------------------------------------------------------


PHASES = {
    # flood_at: (result phase, waiting_for in the text, note)
    "greeting": ("greeting", "greeting", ""),
    "EHLO": ("ehlo", "EHLO", ""),
    "end of data": ("session", "end of data", " (the message may be delivered twice)"),
}


@pytest.mark.parametrize("flood", sorted(FLOODS))
@pytest.mark.parametrize("flood_at", sorted(PHASES))
def test_an_endless_reply_is_a_protocol_failure(smtp_port, flood_at, flood):
    m = message("a@example.com", "b@example.com")
    peer = Peer(flood_at=flood_at, flood=flood)

    async def scenario() -> tuple[BatchResult, float, int]:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            t0 = time.monotonic()
            batch = await deliver([target(A, smtp_port)], [m], hostile_config())
            elapsed = time.monotonic() - t0
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        # The client closed the connection itself: the flooding peer sees it.
        await asyncio.wait_for(peer.closed.wait(), 2.0)
        return batch, elapsed, peak

    async def main() -> tuple[BatchResult, float, int]:
        await peer.start(A, smtp_port)
        try:
            return await scenario()
        finally:
            await peer.stop()

    batch, elapsed, peak = asyncio.run(main())

    phase, waiting_for, note = PHASES[flood_at]
    text = f"protocol error after {waiting_for}: {CAP_TEXT[flood]}"
    assert len(batch.results) == 2
    for r in batch.results:
        assert (r.outcome, r.phase, r.scope, r.code, r.enhanced) == (
            "deferred",
            phase,
            "connection",
            None,
            "4.5.0",
        )
        assert r.text == text + note
    [failure] = batch.host_failures
    assert (failure.phase, failure.code, failure.text) == (phase, None, text)
    # Exim names no error for a reply we refuse to read (only "*" rules match)
    assert failure.error == ""
    if flood_at == "end of data":
        assert batch.connection_error == "" and peer.bodies
    else:
        assert text in batch.connection_error
    # Bounded: the peer (same process, so traced too) writes 64 KiB blocks; the
    # client keeps at most one reply. Without the caps this grows ~100 MB/s.
    assert peak < 2 * MiB, peak
    assert elapsed < 5.0, elapsed  # the caps end it, not the 30 s timeout


def test_a_flooding_host_is_skipped_for_the_rest_of_the_batch(sink_factory, smtp_port):
    good = sink_factory(B)
    messages = [message(f"r{i}@example.com") for i in range(3)]
    peer = Peer(flood_at="EHLO")

    async def body() -> BatchResult:
        return await deliver(
            [target(A, smtp_port), target(B, smtp_port)],
            messages,
            hostile_config(max_messages_per_connection=1, max_connections=1),
        )

    batch = asyncio.run(with_peer(smtp_port, peer, body))
    assert {r.outcome for r in batch.results} == {"delivered"}
    assert len(good.messages) == 3
    assert peer.connections == 1  # not once per connection of the batch
    [failure] = batch.host_failures
    assert failure.text == f"protocol error after EHLO: reply longer than {MAX_REPLY_LINES} lines"


def _reply_of(data: bytes) -> list[str]:
    async def read() -> list[str]:
        reader = asyncio.StreamReader(limit=READ_LIMIT)
        reader.feed_data(data)
        reader.feed_eof()
        conn = Connection(reader, None, target(A, 25), config())  # type: ignore[arg-type]
        return (await conn.reply("EHLO")).lines

    return asyncio.run(read())


def test_reply_caps_are_exact():
    line = b"250-" + b"k" * 10 + b"\r\n"
    assert len(_reply_of(line * (MAX_REPLY_LINES - 1) + b"250 end\r\n")) == MAX_REPLY_LINES
    with pytest.raises(ProtocolError, match=f"longer than {MAX_REPLY_LINES} lines"):
        _reply_of(line * MAX_REPLY_LINES + b"250 end\r\n")
    # bytes: line ends included
    last = b"250 " + b"e" * (MAX_REPLY_BYTES - 6) + b"\r\n"
    assert len(last) == MAX_REPLY_BYTES
    assert _reply_of(last) == [last[4:-2].decode()]
    with pytest.raises(ProtocolError, match=f"longer than {MAX_REPLY_BYTES} bytes"):
        _reply_of(b"250-x\r\n" + last)


# --- still_owner ----------------------------------------------------------------------


def test_losing_ownership_after_354_drops_the_transaction_before_the_final_dot(sink, smtp_port):
    messages = [message(f"r{i}@example.com", f"s{i}@example.com") for i in range(4)]

    def still_owner() -> bool:
        # Ownership is lost once the sink has the first message's recipients:
        # it is asked before MAIL FROM (held) and again after the 354, before
        # the final dot (lost).
        return "RCPT" not in sink.verbs()

    batch = asyncio.run(
        deliver(
            [target(A, smtp_port)],
            messages,
            config(max_messages_per_connection=2, max_connections=1),
            still_owner=still_owner,
        )
    )
    assert batch.abandoned
    # The connection was closed without the dot: the next hop has no copy,
    # and nothing is reported for the message (its recipients have a new owner).
    assert sink.wait_idle()
    assert sink.messages == []
    assert batch.results == []
    assert sink.connections == 1  # the second group never connected
    assert sink.verbs() == ["EHLO", "MAIL", "RCPT", "RCPT"]  # DATA ends at the dot
    assert batch.connection_error == "" and not batch.host_failures


def test_losing_ownership_between_messages_starts_no_mail_from(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(3)]
    batch = asyncio.run(
        deliver(
            [target(A, smtp_port)],
            messages,
            config(max_messages_per_connection=3, max_connections=1),
            still_owner=lambda: len(sink.messages) == 0,
        )
    )
    assert batch.abandoned
    assert [m.rcpt_tos for m in sink.messages] == [["r0@example.com"]]
    assert [r.outcome for r in batch.results] == ["delivered"]
    assert sink.wait_idle()
    assert sink.verbs().count("MAIL") == 1


def test_not_owner_from_the_start_connects_nowhere(sink, smtp_port):
    messages = [message("a@example.com"), message("b@example.com")]
    batch = asyncio.run(
        deliver([target(A, smtp_port)], messages, config(), still_owner=lambda: False)
    )
    assert batch.abandoned and batch.results == [] and not batch.connected
    assert sink.connections == 0


def test_ownership_lost_after_a_failed_target_defers_nothing(sink_factory, smtp_port):
    first = sink_factory(A, greeting="554 5.3.2 No service")
    second = sink_factory(B)
    messages = [message("a@example.com")]
    batch = asyncio.run(
        deliver(
            [target(A, smtp_port), target(B, smtp_port)],
            messages,
            config(),
            # lost while the first target was being tried
            still_owner=lambda: first.connections == 0,
        )
    )
    assert batch.abandoned and batch.results == []
    assert len(batch.host_failures) == 1 and batch.host_failures[0].code == 554
    assert second.connections == 0


def test_still_owner_throughout_changes_nothing(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(5)]
    batch = asyncio.run(
        deliver([target(A, smtp_port)], messages, config(), still_owner=lambda: True)
    )
    assert not batch.abandoned
    assert {r.outcome for r in batch.results} == {"delivered"} and len(batch.results) == 5


# --- load_body ------------------------------------------------------------------------


class Body(bytes):
    """A body whose copies alive are counted (bytes cannot be weakly referenced)."""

    alive = 0
    peak = 0

    def __new__(cls, data: bytes) -> Body:
        obj = super().__new__(cls, data)
        Body.alive += 1
        Body.peak = max(Body.peak, Body.alive)
        return obj

    def __del__(self) -> None:
        Body.alive -= 1


def _lazy(messages: list[OutboundMessage]) -> dict[int, bytes]:
    """Take the bodies out of the messages (as delivery.smtp.deliver does)."""
    stored = {}
    for m in messages:
        stored[m.id] = m.data
        m.data = None
    return stored


def test_bodies_are_loaded_once_each_just_before_the_message(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(4)]
    stored = _lazy(messages)
    calls: list[tuple[int, int, int]] = []

    async def load_body(msg: OutboundMessage) -> bytes:
        # (message, MAIL commands the sink saw, messages it accepted) right now
        calls.append((msg.id, sink.verbs().count("MAIL"), len(sink.messages)))
        return stored[msg.id]

    batch = asyncio.run(
        deliver([target(A, smtp_port)], messages, config(max_connections=1), load_body=load_body)
    )
    assert {r.outcome for r in batch.results} == {"delivered"}
    # once per message, each after the previous was taken and before its MAIL
    assert calls == [(m.id, i, i) for i, m in enumerate(messages)]
    assert [got.data for got in sink.messages] == [stored[m.id] for m in messages]


def test_at_most_one_body_per_connection_is_alive(sink, smtp_port):
    messages = [
        message(f"r{i}@example.com", data=b"Subject: x\r\n\r\n" + b"body text\r\n" * 400)
        for i in range(8)
    ]
    stored = _lazy(messages)
    Body.alive = Body.peak = 0
    loads = 0

    async def load_body(msg: OutboundMessage) -> bytes:
        nonlocal loads
        loads += 1
        await asyncio.sleep(0)  # let the other connection move meanwhile
        return Body(stored[msg.id])

    batch = asyncio.run(
        deliver(
            [target(A, smtp_port)],
            messages,
            config(max_connections=2, max_messages_per_connection=2),
            load_body=load_body,
        )
    )
    assert {r.outcome for r in batch.results} == {"delivered"} and len(sink.messages) == 8
    assert loads == 8
    assert sink.peak_connections == 2
    assert 1 <= Body.peak <= 2, Body.peak
    assert Body.alive == 0  # nothing kept after the round


def test_a_body_that_cannot_be_read_defers_that_message_only(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(3)]
    stored = _lazy(messages)

    async def load_body(msg: OutboundMessage) -> bytes:
        if msg is messages[1]:
            raise LookupError(f"message {msg.id} is no longer stored")
        return stored[msg.id]

    batch = asyncio.run(deliver([target(A, smtp_port)], messages, config(), load_body=load_body))
    by_message = {r.message_id: r for r in batch.results}
    assert by_message[messages[0].id].outcome == "delivered"
    assert by_message[messages[2].id].outcome == "delivered"
    bad = by_message[messages[1].id]
    assert (bad.outcome, bad.phase, bad.scope, bad.code, bad.enhanced) == (
        "deferred",
        "mail",
        "message",
        None,
        "4.3.0",
    )
    assert bad.text == f"cannot read the message body: message {messages[1].id} is no longer stored"
    assert sink.connections == 1 and len(sink.messages) == 2


def test_a_small_body_goes_with_its_final_dot_in_one_write(sink, smtp_port, monkeypatch):
    # One send a message for the body: the dot-stuffed bytes and the final dot
    # together (the claim asked before them: test_losing_ownership_after_354…).
    writes: list[bytes] = []
    write = asyncio.StreamWriter.write

    def counted(self: asyncio.StreamWriter, data: bytes) -> None:
        writes.append(bytes(data))
        write(self, data)

    monkeypatch.setattr(asyncio.StreamWriter, "write", counted)
    m = message("a@example.com", data=b"Subject: s\r\n\r\n.dot\r\nbody\r\n")
    batch = asyncio.run(deliver([target(A, smtp_port)], [m], config()))
    assert [r.outcome for r in batch.results] == ["delivered"]
    assert b"Subject: s\r\n\r\n..dot\r\nbody\r\n.\r\n" in writes  # (the sink's writes too)
    assert sink.wait_idle()
    assert [x.data for x in sink.messages] == [b"Subject: s\r\n\r\n.dot\r\nbody\r\n"]


def test_sending_a_large_body_costs_at_most_one_copy(smtp_port):
    # Lines starting with a dot force the dot-stuffed copy; the client must
    # not make a second one for the final dot nor let the transport buffer
    # the whole message.
    size = 16 * MiB
    line = b".dotted line of text, seventy-odd characters long, to be stuffed...\r\n"
    data = b"Subject: big\r\n\r\n" + line * (size // len(line))
    m = message("a@example.com", data=data)
    peer = Peer()

    async def body() -> BatchResult:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            batch = await deliver([target(A, smtp_port)], [m], config(data_timeout=30.0))
            body.peak = tracemalloc.get_traced_memory()[1] - base  # type: ignore[attr-defined]
        finally:
            tracemalloc.stop()
        return batch

    batch = asyncio.run(with_peer(smtp_port, peer, body))
    assert [r.outcome for r in batch.results] == ["delivered"]
    stuffed_size = len(data) + data.count(b"\r\n.")
    assert peer.bodies == [stuffed_size + 3]
    # one stuffed copy, plus a slice in the transport and the peer's buffers
    assert body.peak < len(data) * 1.2 + 3 * MiB, body.peak  # type: ignore[attr-defined]


def _recording_after(delay: float, events: list[tuple]) -> Callable[[list], Awaitable[None]]:
    """An ``on_sent`` whose record commits ``delay`` seconds later."""

    def on_sent(results: list) -> Awaitable[None]:
        mid = results[0].message_id
        events.append(("sent", mid))

        async def commit() -> None:
            await asyncio.sleep(delay)
            events.append(("recorded", mid))

        return asyncio.ensure_future(commit())

    return on_sent


def test_the_next_body_is_read_while_the_previous_outcome_commits(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(3)]
    stored = _lazy(messages)
    events: list[tuple] = []

    async def load_body(msg: OutboundMessage) -> bytes:
        events.append(("load", msg.id, sink.verbs().count("MAIL")))
        return stored[msg.id]

    batch = asyncio.run(
        deliver(
            [target(A, smtp_port)],
            messages,
            config(max_connections=1),
            load_body=load_body,
            on_sent=_recording_after(0.05, events),
        )
    )
    assert {r.outcome for r in batch.results} == {"delivered"}
    m0, m1, m2 = (m.id for m in messages)
    # each next body is read before the record it waits for is in, and its
    # MAIL FROM goes out only after that record
    assert events == [
        ("load", m0, 0),
        ("sent", m0),
        ("load", m1, 1),
        ("recorded", m0),
        ("sent", m1),
        ("load", m2, 2),
        ("recorded", m1),
        ("sent", m2),
        ("recorded", m2),
    ]
    assert [got.data for got in sink.messages] == [stored[m.id] for m in messages]


def test_a_body_read_ahead_is_dropped_when_the_claim_is_lost_meanwhile(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(3)]
    stored = _lazy(messages)
    owner = True
    reads: list[int] = []

    async def load_body(msg: OutboundMessage) -> bytes:
        reads.append(msg.id)
        await asyncio.sleep(0.2)  # still reading when the claim is found lost
        return stored[msg.id]

    def on_sent(results: list) -> Awaitable[None]:
        async def commit() -> None:
            nonlocal owner
            await asyncio.sleep(0.01)
            owner = False  # lost while the first record commits

        return asyncio.ensure_future(commit())

    batch = asyncio.run(
        deliver(
            [target(A, smtp_port)],
            messages,
            config(max_connections=1),
            still_owner=lambda: owner,
            load_body=load_body,
            on_sent=on_sent,
        )
    )
    assert batch.abandoned
    assert reads == [messages[0].id, messages[1].id]  # the second read was started...
    assert len(sink.messages) == 1 and sink.verbs().count("MAIL") == 1  # ...and never sent
    assert [r.message_id for r in batch.results] == [messages[0].id]


def test_a_body_read_ahead_keeps_at_most_one_body_per_connection_alive(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(4)]
    stored = _lazy(messages)
    Body.alive = Body.peak = 0
    events: list[tuple] = []

    async def load_body(msg: OutboundMessage) -> bytes:
        return Body(stored[msg.id])

    batch = asyncio.run(
        deliver(
            [target(A, smtp_port)],
            messages,
            config(max_connections=1),
            load_body=load_body,
            on_sent=_recording_after(0.05, events),  # the next body is read meanwhile
        )
    )
    assert {r.outcome for r in batch.results} == {"delivered"} and len(sink.messages) == 4
    assert Body.peak == 1  # the sent one is dropped before the next is read
    assert Body.alive == 0
