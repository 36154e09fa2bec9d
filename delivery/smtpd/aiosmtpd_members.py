"""What the aiosmtpd adapter (``session.AiosmtpdSession``) knows of aiosmtpd's members.

aiosmtpd 1.4's public API (``push``, ``check_helo_needed``, ``session``,
``envelope``, ``transport``, ``smtp_*`` with ``@syntax``, the handler hooks)
does not cover what the relay needs; ``AiosmtpdSession``, in ``session``
(the protocol that runs on every message's path), wraps the private members
it needs in small methods with names of their own. ``RELIED_ON`` lists every
private member used there, with its kind: ``tests/test_aiosmtpd_adapter.py``
checks each one against the installed aiosmtpd, and the version against
``SUPPORTED_VERSIONS`` (pyproject pins the same range), so an upgrade that
moves one fails there, by name, instead of in a session.

``scan`` finds, once per class, the members aiosmtpd's own ``__init__``
looks up with ``dir()``/``inspect`` on every connection (the ``smtp_*``
commands, the ``auth_*`` mechanisms, the handler's ``handle_*`` hooks): the
adapter's ``__init__`` only binds them. Nothing here runs on a message's
path from DATA on; ``scan`` runs as a connection is made.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from importlib.metadata import version

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
    Member("SMTP", "_reset_timeout", Kind.METHOD, "overridden: the idle deadline moves"),
    Member("SMTP", "_timeout_duration", Kind.ATTRIBUTE, "_reset_timeout: the idle timeout"),
    Member("SMTP", "_proxy_timeout", Kind.ATTRIBUTE, "_handle_client: PROXY is aiosmtpd's"),
    Member("SMTP", "_enforce_call_limit", Kind.ATTRIBUTE, "_handle_client: limits are aiosmtpd's"),
    Member("SMTP", "_tls_handshake_okay", Kind.ATTRIBUTE, "_command_loop: 554 after a bad TLS"),
    Member("SMTP", "_smtp_methods", Kind.ATTRIBUTE, "_command_loop: a command's method"),
    Member("SMTP", "_set_rset_state", Kind.METHOD, "reset_transaction"),
    Member("SMTP", "_set_post_data_state", Kind.METHOD, "end_transaction"),
    Member("SMTP", "_call_handler_hook", Kind.COROUTINE, "run_data_hook, smtp_QUIT"),
    Member("SMTP", "_handler_coroutine", Kind.ATTRIBUTE, "connection_lost: the session's task"),
    Member("SMTP", "_auth_methods", Kind.ATTRIBUTE, "_unbind: bound methods"),
    Member("SMTP", "_client_connected_cb", Kind.ATTRIBUTE, "_unbind: asyncio's, bound"),
    Member("SMTP", "_create_envelope", Kind.METHOD, "overridden: envelope_class"),
    Member("SMTP", "_handle_client", Kind.COROUTINE, "overridden: serves_client, _command_loop"),
    Member("SMTP", "_timeout_cb", Kind.METHOD, "overridden: before_idle_close"),
    Member("SMTP._reader", "_buffer", Kind.ATTRIBUTE, "buffered_bytes"),
)


@dataclass(frozen=True)
class ClassScan:
    """What aiosmtpd's __init__ finds with dir()/inspect.getmembers(), per class."""

    smtp_methods: dict[str, str]  # command → smtp_* name, of the protocol class
    auth_methods: tuple[str, ...]  # auth_* names of the protocol class
    handle_hooks: dict[str, str]  # hook → handle_* name, of the handler class
    handler_auth: tuple[str, ...]  # auth_* names of the handler class
    ehlo_hook_ver: str | None


_SCANS: dict[tuple[type, type], ClassScan] = {}


def scan(protocol: type, handler: object) -> ClassScan:
    """What aiosmtpd's __init__ would find on ``protocol`` and ``handler``'s class,
    found once per pair of classes (``AiosmtpdSession.__init__`` binds it per connection)."""
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
        found = _SCANS[key] = ClassScan(
            smtp_methods={
                m.replace("smtp_", ""): m for m in dir(protocol) if m.startswith("smtp_")
            },
            auth_methods=tuple(m for m in dir(protocol) if m.startswith("auth_")),
            handle_hooks={m.replace("handle_", ""): m for m in handle_hooks},
            handler_auth=tuple(m for m in dir(handler) if m.startswith("auth_")),
            ehlo_hook_ver=ehlo_ver,
        )
    return found
