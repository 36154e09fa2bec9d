"""Forms of the Queue Viewer: they render the filter bars; queues.filters parses them.

The filters themselves (what a parameter means, how it is validated and
queried) live in queues.filters, shared with the API and the commands; these
forms only give the parameters labels, widgets and choices.
"""

from __future__ import annotations

from django import forms

from queues.filters import MessageStatus, QueueStatus
from queues.models import DeliveryType, MessageSource


def _any(choices) -> list[tuple[str, str]]:
    return [("", "any"), *choices]


class MessageFilterForm(forms.Form):
    """The parameters of queues.filters.MessageFilter (same names)."""

    sender = forms.CharField(required=False, help_text="substring; <> for the null sender")
    recipient = forms.CharField(required=False, help_text="substring of any recipient")
    domain = forms.CharField(required=False, label="Recipient domain")
    subject = forms.CharField(required=False)
    message_id = forms.CharField(required=False, label="Message-ID")
    qid = forms.CharField(required=False, label="Queue id")
    status = forms.ChoiceField(required=False, choices=_any(MessageStatus.choices))
    source = forms.ChoiceField(required=False, choices=_any(MessageSource.choices))
    queue = forms.IntegerField(required=False, min_value=1, label="Queue (number)")
    newer_than = forms.CharField(
        required=False, label="Received within", help_text="e.g. 30m, 2h, or an ISO time"
    )
    older_than = forms.CharField(
        required=False, label="Older than", help_text="e.g. 4h, 2d, or an ISO time"
    )
    min_size = forms.CharField(required=False, label="Size at least", help_text="e.g. 10K, 2MB")
    max_size = forms.CharField(required=False, label="Size at most")
    error = forms.CharField(required=False, label="Last error", help_text="substring")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name, field in self.fields.items():
            field.widget.attrs.setdefault("id", f"f-{name}")
            if field.help_text:
                field.widget.attrs.setdefault("placeholder", field.help_text)


class QueueFilterForm(forms.Form):
    """The parameters of queues.filters.QueueFilter (same names)."""

    name = forms.CharField(required=False, label="Next-hop domain")
    type = forms.ChoiceField(required=False, choices=_any(DeliveryType.choices), label="Type")
    status = forms.ChoiceField(required=False, choices=_any(QueueStatus.choices))
    nonempty = forms.BooleanField(required=False, label="Only with messages")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name, field in self.fields.items():
            field.widget.attrs.setdefault("id", f"qf-{name}")
