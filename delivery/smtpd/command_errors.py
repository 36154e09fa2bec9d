"""What the inbound command loop (``session.AiosmtpdSession._command_loop``)
does with what it cannot run, as aiosmtpd's own loop does: a line longer than
the reader's limit, and an exception a command raised. Neither is on a
message's way; both use only aiosmtpd's public API.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiosmtpd.smtp import TLSSetupException
from aiosmtpd.smtp import log as _aiosmtpd_log


async def discard_long_line(reader: asyncio.StreamReader, consumed: int) -> None:
    """Read past a line longer than the reader's limit, to its end (as aiosmtpd)."""
    await reader.read(consumed)
    while True:
        try:
            await reader.readuntil()
            return
        except asyncio.LimitOverrunError as e:
            await reader.read(e.consumed)


async def answer(session: Any, error: Exception) -> None:
    """What aiosmtpd's loop does with an exception a command raised: the
    handler's reply to it (``handle_exception``), or a TLS set-up error's close."""
    status = "500 Error: Cannot describe error"
    try:
        status = await session.handle_exception(error)
    except Exception as inner:  # noqa: BLE001 - as aiosmtpd
        with contextlib.suppress(Exception):  # an error that cannot be told: the default
            _aiosmtpd_log.exception("%r Exception in handle_exception()", session.session.peer)
            status = f"500 Error: ({inner.__class__.__name__}) {inner}"
    finally:
        if isinstance(error, TLSSetupException):
            assert session.transport is not None
            session.transport.close()
            session.connection_lost(error)
        else:
            await session.push(status)
