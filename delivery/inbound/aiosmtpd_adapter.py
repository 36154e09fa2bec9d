"""The one place that touches aiosmtpd's private members.

aiosmtpd 1.4's public API (``push``, ``check_helo_needed``, ``session``,
``envelope``, ``transport``, ``smtp_*`` with ``@syntax``, the handler hooks)
does not cover what the relay needs: reading DATA in blocks from the
connection's reader, writing a reply without aiosmtpd's own ``push`` (enhanced
status codes, a 421 just before closing), moving the idle timer to the DATA
deadline, knowing that ``connection_made`` is the STARTTLS layer's, calling the
DATA hook after our own DATA reader, refusing a connection without a greeting.

``AiosmtpdSession`` wraps each of those in a small method with a name of its
own; ``InboundSMTP`` uses only these and the public API. ``RELIED_ON`` lists
every private member used here, with its kind: ``tests/test_aiosmtpd_adapter.py``
checks each one against the installed aiosmtpd, and the version against
``SUPPORTED_VERSIONS`` (pyproject pins the same range), so an upgrade that
moves one fails there, by name, instead of in a session.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope

# The aiosmtpd releases this adapter was written for and checked against: [low, high).
SUPPORTED_VERSIONS = ((1, 4, 6), (1, 5))


def installed_version() -> tuple[int, ...]:
    """The installed aiosmtpd's version as numbers: "1.4.6" → (1, 4, 6)."""
    numbers: list[int] = []
    for part in version("aiosmtpd").split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break  # a pre-release or local suffix ends the comparable part
        numbers.append(int(digits))
    return tuple(numbers)


class Kind(enum.Enum):
    METHOD = "a plain (not coroutine) method"
    COROUTINE = "a coroutine function"
    ATTRIBUTE = "an instance attribute of a connected session"


@dataclass(frozen=True)
class Member:
    """A private member of aiosmtpd (or of the asyncio object it hands us) we rely on."""

    owner: str  # "SMTP", or "SMTP._reader" for the connection's StreamReader
    name: str
    kind: Kind
    use: str


RELIED_ON: tuple[Member, ...] = (
    Member("SMTP", "_reader", Kind.ATTRIBUTE, "reader: DATA is read in blocks"),
    Member("SMTP", "_writer", Kind.ATTRIBUTE, "write_raw / drain_writes"),
    Member("SMTP", "_timeout_handle", Kind.ATTRIBUTE, "move_idle_timer"),
    Member("SMTP", "_original_transport", Kind.ATTRIBUTE, "starttls_begun"),
    Member("SMTP", "_reset_timeout", Kind.METHOD, "restart_idle_timer"),
    Member("SMTP", "_set_rset_state", Kind.METHOD, "reset_transaction"),
    Member("SMTP", "_set_post_data_state", Kind.METHOD, "end_transaction"),
    Member("SMTP", "_call_handler_hook", Kind.COROUTINE, "run_data_hook"),
    Member("SMTP", "_create_envelope", Kind.METHOD, "overridden: envelope_class"),
    Member("SMTP", "_handle_client", Kind.COROUTINE, "overridden: serves_client"),
    Member("SMTP", "_timeout_cb", Kind.METHOD, "overridden: before_idle_close"),
    Member("SMTP._reader", "_buffer", Kind.ATTRIBUTE, "buffered_bytes"),
)


class AiosmtpdSession(SMTP):
    """aiosmtpd's SMTP protocol with its private members behind named methods.

    Subclasses override the hooks (``envelope_class``, ``serves_client``,
    ``before_idle_close``) instead of aiosmtpd's private methods.
    """

    # What a new transaction's envelope is (aiosmtpd builds it after RSET, HELO/EHLO, DATA).
    envelope_class: type[Envelope] = Envelope

    # --- hooks for subclasses

    def serves_client(self) -> bool:
        """False: run no command loop (and send no greeting) on this connection."""
        return True

    def before_idle_close(self) -> None:
        """Called when the idle timer fires, just before aiosmtpd closes the connection."""

    # --- the connection

    @property
    def starttls_begun(self) -> bool:
        """STARTTLS ran: ``connection_made`` is now the TLS layer's, not a new client's."""
        return self._original_transport is not None

    @property
    def reader(self) -> asyncio.StreamReader:
        """The connection's reader (aiosmtpd reads commands from it line by line)."""
        return self._reader

    def buffered_bytes(self) -> int:
        """Bytes received and waiting in the reader, not yet returned by a read."""
        return len(self._reader._buffer)  # type: ignore[attr-defined]

    def write_raw(self, data: bytes) -> None:
        """Queue bytes for the client as they are (aiosmtpd's ``push`` adds its own encoding)."""
        self._writer.write(data)

    async def drain_writes(self) -> None:
        """Wait until the socket takes what was written (flow control)."""
        await self._writer.drain()

    # --- the transaction

    def reset_transaction(self) -> None:
        """Start over with a new envelope, as RSET does (aiosmtpd's RSET state)."""
        self._set_rset_state()

    def end_transaction(self) -> None:
        """A new envelope after DATA (aiosmtpd's post-DATA state); the old one is dropped."""
        self._set_post_data_state()

    async def run_data_hook(self) -> Any:
        """The handler's ``handle_DATA`` for the current envelope; its reply."""
        return await self._call_handler_hook("DATA")

    # --- the idle timer (aiosmtpd's ``timeout``)

    def restart_idle_timer(self) -> None:
        """The idle timeout counts again from now."""
        self._reset_timeout()

    def move_idle_timer(self, when: float, callback: Callable[[], None]) -> None:
        """Replace the idle timer by ``callback`` at loop time ``when``.

        It takes the idle timer's place, so ``connection_lost`` cancels it and
        ``restart_idle_timer`` puts the idle timeout back.
        """
        if self._timeout_handle is not None:
            self._timeout_handle.cancel()
        self._timeout_handle = self.loop.call_at(when, callback)

    # --- aiosmtpd's private hooks, overridden here only

    def _create_envelope(self) -> Envelope:
        return self.envelope_class()

    async def _handle_client(self) -> None:
        if not self.serves_client():
            return
        await super()._handle_client()

    def _timeout_cb(self) -> None:
        self.before_idle_close()
        super()._timeout_cb()
