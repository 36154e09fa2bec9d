"""Small factories for the operator surface's tests (actions, API, CLI).

Messages are stored through the real ``message_accept`` (so their bytes carry
our Received header) and then put in the state a test needs.
"""

from __future__ import annotations

from datetime import datetime

from django.contrib.auth.models import Group, User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import (
    DeliveryType,
    Link,
    LinkState,
    Message,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)


def body(subject: str = "hello", text: str = "line one\r\n") -> bytes:
    return (
        f"From: a@example.org\r\nTo: x@example.net\r\nSubject: {subject}\r\n"
        f"Message-ID: <{subject.replace(' ', '-')}@example.org>\r\n\r\n{text}"
    ).encode()


def make_link(name: str = "example.net", **fields) -> Link:
    fields.setdefault("delivery_type", DeliveryType.DNS_MX)
    fields.setdefault("hosts", [{"host": name, "port": 25, "preference": 0, "literal": False}])
    return Link.objects.create(name=name, created_at=clock.now(), **fields)


def make_queue(name: str = "example.net", link: Link | None = None, **fields) -> Queue:
    fields.setdefault("delivery_type", DeliveryType.DNS_MX)
    if link is None and fields["delivery_type"] not in (
        DeliveryType.UNREACHABLE,
        DeliveryType.POISON,
        DeliveryType.DEAD_LETTER,
        DeliveryType.SUBMISSION,
    ):
        link = make_link(name)
    return Queue.objects.create(name=name, link=link, created_at=clock.now(), **fields)


def make_message(
    *rcpts: str,
    sender: str = "a@example.org",
    queue: Queue | None = None,
    rstate: str = RecipientState.QUEUED,
    subject: str = "hello",
    text: str = "line one\r\n",
    received_at: datetime | None = None,
    last_text: str = "",
    **rfields,
) -> Message:
    """A stored message; with ``queue`` its recipients wait there in ``rstate``."""
    rcpts = rcpts or ("u@example.net",)
    env = IncomingEnvelope(
        mail_from=sender,
        recipients=[IncomingRecipient(r) for r in rcpts],
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    message = message_accept(env, body(subject, text))
    if received_at is not None:
        Message.objects.filter(pk=message.pk).update(received_at=received_at)
    if queue is not None:
        now = clock.now()
        final = rstate in (RecipientState.DELIVERED, RecipientState.FAILED)
        Recipient.objects.filter(message=message).update(
            queue=queue,
            state=rstate,
            next_attempt_at=now,
            last_text=last_text,
            final_at=now if final else None,
            **rfields,
        )
        Message.objects.filter(pk=message.pk).update(
            state=MessageState.DONE if final else MessageState.QUEUED,
            completed_at=now if final else None,
        )
    message.refresh_from_db()
    return message


def make_user(role: str | None = "operator", name: str | None = None) -> User:
    # No password: hashing one costs a third of a second; tokens need none.
    user = User.objects.create_user(name or f"{role or 'nobody'}-user")
    if role == "superuser":
        user.is_superuser = True
        user.save()
    elif role:
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


def api_client(user: User | None) -> APIClient:
    """A client that authenticates with the user's token (none: anonymous)."""
    client = APIClient()
    if user is not None:
        token, _ = Token.objects.get_or_create(user=user)
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def rstates(message: Message) -> list[str]:
    return list(message.recipients.order_by("id").values_list("state", flat=True))


__all__ = ["LinkState"]
