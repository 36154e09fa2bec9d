"""``delivery.smtpd.state`` declares what the parts of an inbound session
(``commands.Commands``, ``auth.AuthCommand``) use of the session they are bases
of: a declaration that drifts from ``session.InboundSMTP`` would lie to the
reader and to a type checker. Every member it declares is one the session
has: a method or property of its class, or an attribute that the session,
its adapter or aiosmtpd's ``SMTP`` sets on the instance."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Protocol

from aiosmtpd.smtp import SMTP

from delivery.smtpd.session import AiosmtpdSession, InboundSMTP
from delivery.smtpd.state import SessionHost, SessionState


def declared(protocol: type) -> tuple[set[str], set[str]]:
    """(attributes, methods and properties) a Protocol declares."""
    attributes = set(protocol.__annotations__)
    callables = {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("__") and (callable(value) or isinstance(value, property))
    }
    return attributes, callables


def assigned_on_self(*classes: type) -> set[str]:
    """Every ``self.X = ...`` (or ``self.X: T = ...``) in the classes' source."""
    names: set[str] = set()
    for cls in classes:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign | ast.AugAssign)
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
    return names


def test_every_member_the_parts_use_is_declared_and_the_session_has_it() -> None:
    attributes, callables = declared(SessionState)
    assert attributes and callables
    for name in callables:
        assert hasattr(InboundSMTP, name), f"SessionState.{name}: InboundSMTP has no such member"
    set_on_instance = assigned_on_self(InboundSMTP, AiosmtpdSession, SMTP) | set(vars(InboundSMTP))
    missing = sorted(attributes - set_on_instance)
    assert not missing, f"declared in SessionState, never set on a session: {missing}"


def test_the_declarations_are_protocols_and_the_session_is_not_one() -> None:
    # The parts name SessionState as their base only for type checkers: at run
    # time the methods must be the session's own, never a Protocol's stubs.
    assert issubclass(SessionState, Protocol) and issubclass(SessionHost, Protocol)  # type: ignore[arg-type]
    assert SessionState not in InboundSMTP.__mro__
    assert all(not getattr(cls, "_is_protocol", False) for cls in InboundSMTP.__mro__)
