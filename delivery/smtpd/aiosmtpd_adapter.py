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
import inspect
import socket
import ssl
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from aiosmtpd import _get_or_new_eventloop
from aiosmtpd.smtp import (
    DATA_SIZE_DEFAULT,
    SMTP,
    Envelope,
    _AuthMechAttr,
    login_always_fail,
)
from aiosmtpd.smtp import __ident__ as _AIOSMTPD_IDENT

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


# The options ``AiosmtpdSession.__init__`` sets up itself; any other option
# (AUTH callbacks, call limits, PROXY protocol) goes through aiosmtpd's own __init__.
FAST_INIT_OPTIONS = frozenset(
    {
        "data_size_limit",
        "enable_SMTPUTF8",
        "decode_data",
        "hostname",
        "ident",
        "tls_context",
        "timeout",
        "loop",
    }
)


class _BoundOnUse(Mapping[str, Any]):
    """``{"MAIL": session.smtp_MAIL, …}`` as aiosmtpd builds it, bound when looked up
    (a session uses a handful of its ~15 commands; binding them all cost more)."""

    __slots__ = ("_names", "_obj")

    def __init__(self, obj: object, names: dict[str, str]) -> None:
        self._obj = obj
        self._names = names

    def __getitem__(self, key: str) -> Any:
        return getattr(self._obj, self._names[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True)
class _ClassScan:
    """What aiosmtpd's __init__ finds with dir()/inspect.getmembers(), per class."""

    smtp_methods: dict[str, str]  # command → smtp_* name, of the protocol class
    auth_methods: tuple[str, ...]  # auth_* names of the protocol class
    handle_hooks: tuple[str, ...]  # handle_* names of the handler class
    handler_auth: tuple[str, ...]  # auth_* names of the handler class
    ehlo_hook_ver: str | None


_SCANS: dict[tuple[type, type], _ClassScan] = {}


def _scan(protocol: type, handler: object) -> _ClassScan:
    key = (protocol, type(handler))
    found = _SCANS.get(key)
    if found is None:
        handle_hooks = tuple(m for m in dir(handler) if m.startswith("handle_"))
        ehlo_ver = None
        if "handle_EHLO" in handle_hooks:
            count = len(inspect.signature(handler.handle_EHLO).parameters)  # type: ignore[attr-defined]
            if count not in (4, 5):
                raise RuntimeError("Unsupported EHLO Hook")
            ehlo_ver = "old" if count == 4 else "new"
        found = _SCANS[key] = _ClassScan(
            smtp_methods={
                m.replace("smtp_", ""): m for m in dir(protocol) if m.startswith("smtp_")
            },
            auth_methods=tuple(m for m in dir(protocol) if m.startswith("auth_")),
            handle_hooks=handle_hooks,
            handler_auth=tuple(m for m in dir(handler) if m.startswith("auth_")),
            ehlo_hook_ver=ehlo_ver,
        )
    return found


class AiosmtpdSession(SMTP):
    """aiosmtpd's SMTP protocol with its private members behind named methods.

    Subclasses override the hooks (``envelope_class``, ``serves_client``,
    ``before_idle_close``) instead of aiosmtpd's private methods.

    ``__init__`` sets the same attributes as aiosmtpd's, but without its
    per-connection ``dir()``/``inspect.getmembers()`` scans of the protocol
    and the handler (a quarter of the ingress's CPU per message): the names
    are found once per class (``_scan``) and only bound per connection. The
    handler's ``handle_*``/``auth_*`` hooks are therefore looked up on its
    class (``dir`` of the instance, once per handler class), and the
    "Available AUTH mechanisms" line aiosmtpd logs per connection is not
    logged. ``tests/test_aiosmtpd_adapter.py`` compares the attributes with
    those aiosmtpd's own __init__ sets.
    """

    # What a new transaction's envelope is (aiosmtpd builds it after RSET, HELO/EHLO, DATA).
    envelope_class: type[Envelope] = Envelope

    def __init__(self, handler: Any, **options: Any) -> None:
        tls_context = options.get("tls_context")
        if not FAST_INIT_OPTIONS.issuperset(options) or (
            tls_context is not None
            and (
                tls_context.verify_mode not in {ssl.CERT_NONE, ssl.CERT_OPTIONAL}
                or tls_context.check_hostname
            )
        ):
            # Options set up by aiosmtpd alone, or a context it warns about: its own path.
            super().__init__(handler, **options)
            return
        self.__ident__ = options.get("ident") or _AIOSMTPD_IDENT
        self.loop = loop = options.get("loop") or _get_or_new_eventloop()
        asyncio.StreamReaderProtocol.__init__(
            self,
            asyncio.StreamReader(loop=loop, limit=self.line_length_limit),
            client_connected_cb=self._cb_client_connected,
            loop=loop,
        )
        self.event_handler = handler
        data_size_limit = options.get("data_size_limit", DATA_SIZE_DEFAULT)
        assert data_size_limit is None or isinstance(data_size_limit, int)
        self.data_size_limit = data_size_limit
        self.enable_SMTPUTF8 = options.get("enable_SMTPUTF8", False)
        self._decode_data = options.get("decode_data", False)
        self.command_size_limits.clear()
        self.hostname = options.get("hostname") or socket.getfqdn()
        self.tls_context = tls_context
        self.require_starttls = tls_context and False  # as aiosmtpd: None or False
        self._timeout_duration = options.get("timeout", 300)
        self._timeout_handle = None
        self._tls_handshake_okay = True
        self._tls_protocol = None
        self._original_transport = None
        self.session = None
        self.envelope = None
        self.transport = None
        self._handler_coroutine = None
        self._auth_require_tls = True
        self._proxy_timeout = None
        self._auth_callback = login_always_fail
        self._authenticator = None
        self._auth_required = False
        scan = _scan(type(self), handler)
        auth: dict[str, _AuthMechAttr] = {}
        for obj, names in ((self, scan.auth_methods), (handler, scan.handler_auth)):
            for name in names:
                method = getattr(obj, name)
                mechanism = getattr(
                    method, "__auth_mechanism_name__", name.replace("auth_", "").replace("__", "-")
                )
                auth[mechanism] = _AuthMechAttr(method, obj is self)
        self._auth_methods = auth
        self._handle_hooks = {
            name.replace("handle_", ""): getattr(handler, name) for name in scan.handle_hooks
        }
        self._ehlo_hook_ver = scan.ehlo_hook_ver
        self._smtp_methods = _BoundOnUse(self, scan.smtp_methods)
        self._enforce_call_limit = False

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
