"""Envelope edits of a dead letter resubmitted by an operator.

A message that failed for a wrong address (a typo in the recipient, a sender
the next hop refuses) is resubmitted with the address corrected; the stored
bytes, headers included, stay exactly as received. Addresses are checked as
SMTP checks them at RCPT/MAIL (``queues.addresses``, the parser SMTP uses): the same syntax,
domain normalisation and refusal of sender-specified routing.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import QuerySet

from queues import addresses
from queues.accept import recipient_domain
from queues.models import Message, Recipient
from queues.services.action_errors import ActionConflict, ActionInvalid


def _path(text: str) -> str:
    text = text.strip()
    if text.startswith("<") and text.endswith(">"):
        text = text[1:-1].strip()
    return text


def _mailbox(what: str, text: str, utf8: bool) -> str:
    """``text`` as an envelope address in its stored form ("" for ``<>``)."""
    path = _path(text)
    try:
        mailbox = addresses.parse_mailbox(path, utf8=utf8)
    except addresses.NeedsSMTPUTF8:
        raise ActionInvalid(
            f"{what}: {text!r} is not ASCII and the message was not sent with SMTPUTF8"
        ) from None
    except addresses.PathSyntaxError as exc:
        raise ActionInvalid(f"{what}: {text!r} is not an address ({exc})") from None
    if mailbox is None:
        if what == "recipient":
            raise ActionInvalid("recipient: <> is not a recipient")
        return ""
    if mailbox.routes_by_sender or mailbox.route:
        raise ActionInvalid(f"{what}: {text!r} uses sender-specified routing")
    if not mailbox.domain:
        raise ActionInvalid(f"{what}: {text!r} has no domain")
    return mailbox.address


@dataclass(frozen=True)
class Edits:
    """A corrected recipient (``old`` names which one, "" when it has one) and
    a corrected sender (None: unchanged; "<>": the null sender)."""

    recipient: str = ""
    old: str = ""
    sender: str | None = None

    def __bool__(self) -> bool:
        return bool(self.recipient) or self.sender is not None

    def apply(self, message_id: int, dead: QuerySet[Recipient]) -> list[str]:
        """Change the envelope of the locked dead letter ``message_id`` (whose dead
        recipients are ``dead``); returns the changes as "before → after" lines."""
        message = Message.objects.defer("data").get(pk=message_id)
        changes: list[str] = []
        if self.recipient:
            rows = list(dead.order_by("id"))
            if self.old:
                rows = [r for r in rows if r.address.lower() == _path(self.old).lower()]
                if not rows:
                    raise ActionConflict(
                        f"message {message.qid} has no dead recipient {_path(self.old)}"
                    )
            if len(rows) != 1:
                names = ", ".join(r.address for r in rows)
                raise ActionConflict(
                    f"message {message.qid} has {len(rows)} dead recipients ({names}): "
                    "name the one to correct as old=new"
                )
            row = rows[0]
            address = _mailbox("recipient", self.recipient, message.smtputf8)
            Recipient.objects.filter(pk=row.pk).update(
                address=address, domain=recipient_domain(address)
            )
            changes.append(f"recipient: {row.address} → {address}")
        if self.sender is not None:
            sender = _mailbox("sender", self.sender, message.smtputf8)
            Message.objects.filter(pk=message.pk).update(mail_from=sender)
            changes.append(f"sender: <{message.mail_from}> → <{sender}>")
        return changes


def parse(recipient: str | None, sender: str | None) -> Edits:
    """The edits as the edges give them: ``recipient`` "new" or "old=new" ("" or
    None: none), ``sender`` an address or "<>" (None or "": unchanged)."""
    recipient = (recipient or "").strip()
    old = ""
    before, eq, after = recipient.partition("=")
    # "old=new" when both sides are addresses ("=" may be in a local part too).
    if eq and "@" in before and "@" in after:
        old, recipient = before.strip(), after.strip()
    return Edits(recipient=recipient, old=old, sender=sender if sender else None)
