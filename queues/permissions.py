"""Roles of the operator surface, as Django groups (created by migration 0003).

- ``viewer``: reads queues, links, messages (envelope, recipients, attempts,
  subject) and the audit log; never message bodies, headers or exports;
- ``operator``: everything a viewer does, plus message content and every
  action (retry, resubmit, suspend, resume, remove, export);
- ``admin``: a superuser or a member of the ``admin`` group: everything.

A signed-in user in none of these groups sees nothing (403). The REST API
and the Queue Viewer both decide with the functions and classes below.
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from rest_framework.permissions import BasePermission

VIEWER = "viewer"
OPERATOR = "operator"
ADMIN = "admin"
ROLES = (VIEWER, OPERATOR, ADMIN)
_RANK = {VIEWER: 1, OPERATOR: 2, ADMIN: 3}


def user_role(user: AbstractBaseUser | AnonymousUser | None) -> str | None:
    """The strongest role of ``user`` (``admin``, ``operator``, ``viewer``) or None."""
    if user is None or not user.is_authenticated or not user.is_active:
        return None
    cached = getattr(user, "_mailrelay_role", False)
    if cached is not False:
        return cached
    if user.is_superuser:
        role: str | None = ADMIN
    else:
        names = set(user.groups.filter(name__in=ROLES).values_list("name", flat=True))
        role = max(names, key=_RANK.__getitem__) if names else None
    user._mailrelay_role = role  # one query per request, not one per check
    return role


def has_role(user, role: str) -> bool:
    current = user_role(user)
    return current is not None and _RANK[current] >= _RANK[role]


def can_view(user) -> bool:
    return has_role(user, VIEWER)


def can_act(user) -> bool:
    """Operator actions: retry, resubmit, suspend, resume, remove."""
    return has_role(user, OPERATOR)


def can_read_content(user) -> bool:
    """Message bodies, full headers and exports."""
    return has_role(user, OPERATOR)


class IsViewer(BasePermission):
    """Any role may read. Anonymous: 401 (through the authenticators); no role: 403."""

    message = "your account has no Queue Viewer role (viewer, operator or admin)"

    def has_permission(self, request, view) -> bool:
        return can_view(request.user)


class IsOperator(BasePermission):
    message = "this needs the operator role"

    def has_permission(self, request, view) -> bool:
        return can_act(request.user)


class RoleRequired(BasePermission):
    """At least ``role`` (an action's required role, from the tables of queues.spec)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.message = f"this needs the {role} role"

    def has_permission(self, request, view) -> bool:
        return has_role(request.user, self.role)


class CanReadContent(BasePermission):
    message = "message content needs the operator role"

    def has_permission(self, request, view) -> bool:
        return can_read_content(request.user)


class IsAdmin(BasePermission):
    message = "this needs the admin role"

    def has_permission(self, request, view) -> bool:
        return has_role(request.user, ADMIN)
