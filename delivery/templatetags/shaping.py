"""``{% load shaping %}``: ``{{ link|effective_limits }}`` for the queue list."""

from __future__ import annotations

from django import template

from delivery.shaping.gate import effective_limits as _effective_limits
from queues.models import Link

register = template.Library()


@register.filter
def effective_limits(link: Link | None) -> str:
    return _effective_limits(link)
