"""``{% message_explain m as ex %}``: the explain block of the message page."""

from __future__ import annotations

from django import template

from insight.explain import MessageExplain, explain_message
from queues.lib import clock
from queues.models import Message

register = template.Library()


@register.simple_tag
def message_explain(message: Message) -> MessageExplain:
    return explain_message(message, clock.now())
