"""The aiosmtpd adapter against the installed aiosmtpd.

``AiosmtpdSession`` (in ``delivery.smtpd.session``) is the one place that
uses aiosmtpd's private members (``aiosmtpd_members.RELIED_ON``). An aiosmtpd
release may rename or reshape any of them without notice: these tests fail
by the member's name when one is gone or has changed kind, when the
installed version leaves the range the adapter was written for, and when a
member no longer does what the adapter's method says (each method is driven
on a real loopback connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import numbers
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest
from aiosmtpd.smtp import SMTP, Envelope

from delivery.smtpd.aiosmtpd_members import (
    RELIED_ON,
    SUPPORTED_VERSIONS,
    Kind,
    Member,
    installed_version,
)
from delivery.smtpd.session import AiosmtpdSession

# What each attribute holds on a freshly connected session (no STARTTLS yet).
ATTRIBUTE_TYPES: dict[str, type] = {
    "SMTP._reader": asyncio.StreamReader,
    "SMTP._writer": asyncio.StreamWriter,
    "SMTP._timeout_handle": asyncio.TimerHandle,
    "SMTP._timeout_duration": numbers.Real,
    "SMTP._proxy_timeout": type(None),
    "SMTP._enforce_call_limit": bool,
    "SMTP._tls_handshake_okay": bool,
    "SMTP._smtp_methods": Mapping,
    "SMTP._original_transport": type(None),
    "SMTP._reader._buffer": bytearray,
    "SMTP._handler_coroutine": asyncio.Task,
    "SMTP._auth_methods": dict,
    "SMTP._client_connected_cb": Callable,
}


def member_id(member: Member) -> str:
    return f"{member.owner}.{member.name}"


class Handler:
    """An aiosmtpd handler that records the DATA hook's arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def handle_DATA(self, smtp: SMTP, session: Any, envelope: Envelope) -> str:  # noqa: N802
        self.calls.append((smtp, session, envelope))
        return "250 stored"


class Probe(AiosmtpdSession):
    """The adapter with its hooks observable."""

    def __init__(self, handler: Handler, *, serve: bool = True, timeout: float = 30) -> None:
        super().__init__(handler, loop=asyncio.get_running_loop(), timeout=timeout)
        self.serve = serve
        self.idle_closes = 0

    def serves_client(self) -> bool:
        return self.serve

    def before_idle_close(self) -> None:
        self.idle_closes += 1


class Tagged(Envelope):
    pass


@contextlib.asynccontextmanager
async def connected(
    **options: Any,
) -> AsyncIterator[tuple[Probe, asyncio.StreamReader, asyncio.StreamWriter]]:
    """A ``Probe`` serving one real loopback connection, and the client's streams."""
    sessions: list[Probe] = []
    made = asyncio.Event()

    def factory() -> Probe:
        session = Probe(Handler(), **options)
        sessions.append(session)
        made.set()
        return session

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await asyncio.wait_for(made.wait(), 5)
        yield sessions[0], reader, writer
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, 10))


# --------------------------------------------------------------- version and members


def test_the_installed_aiosmtpd_is_a_version_the_adapter_was_written_for():
    low, high = SUPPORTED_VERSIONS
    installed = installed_version()
    assert low <= installed < high, (
        f"aiosmtpd {'.'.join(map(str, installed))} is installed; AiosmtpdSession was written "
        f"for >={'.'.join(map(str, low))},<{'.'.join(map(str, high))}: check every member "
        "in RELIED_ON against the new release before widening the range"
    )


@pytest.mark.parametrize(
    "member", [m for m in RELIED_ON if m.kind is not Kind.ATTRIBUTE], ids=member_id
)
def test_every_private_method_the_adapter_relies_on_is_still_there_and_of_its_kind(member):
    assert member.owner == "SMTP", f"{member_id(member)}: only SMTP's methods are relied on"
    try:
        found = inspect.getattr_static(SMTP, member.name)
    except AttributeError:
        pytest.fail(f"aiosmtpd's SMTP.{member.name} is gone (used by: {member.use})")
    assert inspect.isfunction(found), (
        f"aiosmtpd's SMTP.{member.name} is no longer a plain method but {type(found).__name__}"
    )
    coroutine = inspect.iscoroutinefunction(found)
    assert coroutine == (member.kind is Kind.COROUTINE), (
        f"aiosmtpd's SMTP.{member.name} is {'now' if coroutine else 'no longer'} a coroutine "
        f"function; AiosmtpdSession expects {member.kind.value} (used by: {member.use})"
    )


@pytest.mark.parametrize(
    "member", [m for m in RELIED_ON if m.kind is Kind.ATTRIBUTE], ids=member_id
)
def test_every_private_attribute_the_adapter_relies_on_is_set_on_a_connection(member):
    async def scenario() -> None:
        async with connected() as (session, _reader, _writer):
            await asyncio.sleep(0)  # let connection_made's reader/writer callback run
            owner: Any = session
            for part in member.owner.split(".")[1:]:
                owner = getattr(owner, part)
            state = vars(owner)
            assert member.name in state, (
                f"aiosmtpd no longer sets {member_id(member)} on a connected session "
                f"(used by: {member.use})"
            )
            expected = ATTRIBUTE_TYPES[member_id(member)]
            value = state[member.name]
            assert isinstance(value, expected), (
                f"{member_id(member)} holds {type(value).__name__}, not {expected.__name__} "
                f"(used by: {member.use})"
            )

    run(scenario())


def test_every_member_relied_on_has_its_expected_type_declared_here():
    attributes = {member_id(m) for m in RELIED_ON if m.kind is Kind.ATTRIBUTE}
    assert attributes == set(ATTRIBUTE_TYPES)


def test_the_overridden_hooks_keep_the_kind_of_the_methods_they_replace():
    for name in ("_create_envelope", "_handle_client", "_timeout_cb"):
        ours = inspect.getattr_static(AiosmtpdSession, name)
        theirs = inspect.getattr_static(SMTP, name)
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs), name


# --------------------------------------------------------------- what each method does


def test_a_session_ended_by_quit_is_freed_without_the_garbage_collector():
    """QUIT ends the session's task by returning (aiosmtpd's QUIT cancels it, and
    the CancelledError's traceback holds the session in a reference cycle), and
    connection_lost drops what refers back to it: with the collector off, the
    session is gone as soon as its connection is."""

    async def scenario() -> None:
        sessions: list[weakref.ref[Probe]] = []

        def factory() -> Probe:
            session = Probe(Handler())
            sessions.append(weakref.ref(session))
            return session

        server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await reader.readline()).startswith(b"220 ")
        session = sessions[0]()
        assert session is not None
        task = session._handler_coroutine
        del session
        writer.write(b"QUIT\r\n")
        assert (await reader.readline()).startswith(b"221 ")
        assert await reader.read() == b""  # the server closed the connection
        writer.close()
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0)  # connection_lost's callbacks
        assert task.done() and not task.cancelled()
        del task
        assert sessions[0]() is None

    gc.disable()
    try:
        run(scenario())
    finally:
        gc.enable()


@pytest.mark.parametrize("loop", ["the adapter's", "aiosmtpd's"])
def test_quit_ends_the_command_loop_before_a_line_sent_after_it(loop):
    """QUIT's 221 is the session's last reply, in the adapter's command loop and
    in aiosmtpd's (used with a command call limit, PROXY or REQUIRE STARTTLS):
    a line pipelined after QUIT is not answered. The adapter's loop ends with
    QUIT and does not run it either; aiosmtpd's reads it from its buffer before
    the connection's loss cancels it (as with aiosmtpd's own QUIT), answering
    into a closed transport."""
    options = {"command_call_limit": 100} if loop == "aiosmtpd's" else {}
    noops: list[str] = []

    class Noting(Handler):
        async def handle_NOOP(self, server: Any, session: Any, envelope: Any, arg: str) -> str:
            noops.append(arg)
            return "250 OK"

    async def scenario() -> None:
        def factory() -> AiosmtpdSession:
            return AiosmtpdSession(Noting(), loop=asyncio.get_running_loop(), **options)

        server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            assert (await reader.readline()).startswith(b"220 ")
            writer.write(b"QUIT\r\nNOOP\r\n")
            assert (await reader.readline()).startswith(b"221 ")
            assert await reader.read() == b""  # nothing after the 221: closed
            assert noops == ([] if loop == "the adapter's" else [None])
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    run(scenario())


def test_a_session_that_serves_its_client_greets_and_answers():
    async def scenario() -> None:
        async with connected() as (session, reader, writer):
            assert (await reader.readline()).startswith(b"220 ")
            writer.write(b"NOOP\r\n")
            assert (await reader.readline()).startswith(b"250")
            assert session.starttls_begun is False

    run(scenario())


def test_a_session_that_does_not_serve_its_client_sends_no_greeting():
    async def scenario() -> None:
        async with connected(serve=False) as (session, reader, writer):
            session.write_raw(b"421 busy\r\n")
            await session.drain_writes()
            assert session.transport is not None
            session.transport.close()
            assert await reader.read() == b"421 busy\r\n"

    run(scenario())


def test_the_idle_timer_calls_the_hook_before_closing():
    async def scenario() -> None:
        async with connected(timeout=0.05) as (session, reader, _writer):
            assert (await reader.readline()).startswith(b"220 ")
            assert await reader.read() == b""  # closed by the idle timer
            assert session.idle_closes == 1

    run(scenario())


def test_moving_the_idle_timer_replaces_it_and_restarting_puts_it_back():
    async def scenario() -> None:
        async with connected(timeout=30) as (session, reader, _writer):
            assert (await reader.readline()).startswith(b"220 ")
            loop = asyncio.get_running_loop()
            fired = asyncio.Event()
            session.move_idle_timer(loop.time() + 0.01, fired.set)
            await fired.wait()  # the moved timer fires ...
            session.move_idle_timer(loop.time() + 0.01, fired.clear)
            session.restart_idle_timer()  # ... and a restart cancels a moved one
            await asyncio.sleep(0.05)
            assert fired.is_set()
            assert session.idle_closes == 0

    run(scenario())


def test_bytes_not_yet_read_are_counted_in_the_reader_buffer():
    async def scenario() -> None:
        async with connected(serve=False) as (session, _reader, writer):
            writer.write(b"x" * 300)
            await writer.drain()
            while session.buffered_bytes() < 300:
                await asyncio.sleep(0.005)  # the bytes cross loopback: no event tells us
            assert await session.reader.readexactly(100) == b"x" * 100
            assert session.buffered_bytes() == 200

    run(scenario())


def test_transactions_start_over_with_the_envelope_class_and_the_data_hook_gets_them():
    async def scenario() -> None:
        async with connected(serve=False) as (session, _reader, _writer):
            session.envelope_class = Tagged
            session.reset_transaction()
            first = session.envelope
            assert isinstance(first, Tagged)
            assert await session.run_data_hook() == "250 stored"
            handler = session.event_handler
            assert handler.calls == [(session, session.session, first)]
            session.end_transaction()
            assert isinstance(session.envelope, Tagged) and session.envelope is not first

    run(scenario())


# --------------------------------------------------------------- the fast __init__


def _state(session: SMTP) -> dict[str, Any]:
    """A session's attributes, comparable across two instances."""
    out: dict[str, Any] = {}
    for name, value in vars(session).items():
        if name in ("_stream_reader", "_stream_reader_wr", "_strong_reader", "_closed", "_loop"):
            out[name] = type(value).__name__
        elif name in ("_smtp_methods", "_handle_hooks"):
            out[name] = {k: getattr(v, "__func__", v) for k, v in value.items()}
        elif name == "_auth_methods":
            out[name] = {
                k: (getattr(v.method, "__func__", v.method), v.is_builtin) for k, v in value.items()
            }
        elif name in ("_client_connected_cb", "_over_ssl"):
            out[name] = getattr(value, "__func__", value)
        else:
            out[name] = value
    return out


class AuthHandler(Handler):
    async def handle_EHLO(self, server, session, envelope, hostname, responses):  # noqa: N802
        return responses

    async def auth_CUSTOM(self, server, args):  # noqa: N802
        return None


@pytest.mark.parametrize("handler_class", [Handler, AuthHandler])
def test_the_fast_init_sets_what_aiosmtpds_own_init_sets(handler_class):
    """``AiosmtpdSession.__init__`` skips aiosmtpd's per-connection dir() scans; the
    session it builds must hold the same attributes with the same values."""
    import ssl as ssl_module

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        handler = handler_class()
        context = ssl_module.SSLContext(ssl_module.PROTOCOL_TLS_SERVER)
        for tls in (None, context):
            options = dict(
                data_size_limit=1000,
                enable_SMTPUTF8=True,
                decode_data=False,
                hostname="relay.test",
                ident="ESMTP test",
                tls_context=tls,
                timeout=42,
                loop=loop,
            )
            fast = Probe.__new__(Probe)
            AiosmtpdSession.__init__(fast, handler, **options)
            slow = Probe.__new__(Probe)
            SMTP.__init__(slow, handler, **options)
            assert _state(fast) == _state(slow)
            assert set(fast._smtp_methods) >= {"EHLO", "MAIL", "RCPT", "DATA", "QUIT"}

    run(scenario())


def test_options_the_fast_init_does_not_know_go_through_aiosmtpd():
    async def scenario() -> None:
        session = Probe.__new__(Probe)
        AiosmtpdSession.__init__(
            session, Handler(), loop=asyncio.get_running_loop(), command_call_limit=7
        )
        assert session._enforce_call_limit is True

    run(scenario())


# ------------------------------------------------- the command loop and the idle timer


class Booms(Probe):
    """A command whose method raises: the loop answers with the handler's reply."""

    async def smtp_BOOM(self, arg: str | None) -> None:  # noqa: N802 - an SMTP command
        raise ValueError("boom")


class AiosmtpdLoop(Booms):
    """The same session on aiosmtpd's own command loop."""

    async def _handle_client(self) -> None:
        await SMTP._handle_client(self)


# Lines whose replies the loops must agree on: commands in any case, an empty
# line, lines over the command limit and over the reader's limit, bytes that
# are not ASCII in the command and in an argument, a command that raises, and
# unknown commands until the budget closes the session.
SCRIPT = [
    b"NOOP",
    b"noop   ",
    b"",
    b"HELO client.test",
    b"NOOP " + b"x" * 600,
    b"NOOP " + b"y" * 3000,
    b"\xffOOP",
    b"MAIL FROM:<\xc3\xa9@example.org>",
    b"BOOM",
    b"EHLO client.test",
    b"RSET",
    b"FOO",
    b"BAR x",
    b"FOO",
    b"FOO",
    b"FOO",
    b"NOOP",
]


async def _transcript(session_class: type[Probe]) -> list[bytes]:
    """The replies to SCRIPT, sent line by line, until the session closes."""

    def factory() -> Probe:
        return session_class(Handler())

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    replies = [await reader.readline()]
    try:
        for line in SCRIPT:
            writer.write(line + b"\r\n")
            reply = await reader.readline()
            while reply[3:4] == b"-":
                replies.append(reply)
                reply = await reader.readline()
            replies.append(reply)
            if not reply:
                break
    finally:
        writer.close()
        server.close()
        await server.wait_closed()
    return replies


def test_the_lean_command_loop_answers_every_line_as_aiosmtpds_own():
    async def scenario() -> tuple[list[bytes], list[bytes]]:
        return await _transcript(Booms), await _transcript(AiosmtpdLoop)

    ours, theirs = run(scenario())
    assert ours == theirs
    assert b"502 5.5.1 Too many unrecognized commands, goodbye.\r\n" in ours
    assert ours[-1] == b""  # closed after the budget, as aiosmtpd closes it
    assert b"500 Error: (ValueError) boom\r\n" in ours


def test_a_command_moves_the_idle_deadline_without_a_new_timer():
    async def scenario() -> None:
        async with connected(timeout=30) as (session, reader, writer):
            assert (await reader.readline()).startswith(b"220 ")
            armed = session._timeout_handle
            deadline = session._idle_at
            writer.write(b"NOOP\r\n")
            assert (await reader.readline()).startswith(b"250")
            assert session._timeout_handle is armed  # no timer made and cancelled per command
            assert session._idle_at > deadline

    run(scenario())


def test_a_session_busy_past_its_timeout_stays_and_closes_a_timeout_after_its_last_command():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with connected(timeout=0.3) as (session, reader, writer):
            assert (await reader.readline()).startswith(b"220 ")
            started = last = loop.time()
            while last - started < 0.8:  # well past the timeout, never idle for it
                await asyncio.sleep(0.1)
                writer.write(b"NOOP\r\n")
                assert (await reader.readline()).startswith(b"250")
                last = loop.time()
            assert await reader.read() == b""  # then idle: closed by the idle timer
            idle = loop.time() - last
            assert 0.3 - 0.05 <= idle < 0.3 + 0.5, idle
            assert session.idle_closes == 1

    run(scenario())
