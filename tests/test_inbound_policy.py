"""The pure inbound policy: paths, ESMTP parameters, relay decisions."""

from __future__ import annotations

import ipaddress

import pytest

from delivery.smtpd import policy
from delivery.smtpd.policy import Mailbox, Refused
from delivery.smtpd.session import enhance

ACCEPTED = frozenset({"relay.test"})
NETWORKS = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8::/32"))


def rcpt(arg: str, *, utf8: bool = False) -> Mailbox:
    return policy.parse_rcpt(arg, extended=True, utf8=utf8)[0]


def refusal_for(arg: str, *, trusted: bool) -> str | None:
    return policy.recipient_refusal(rcpt(arg), trusted=trusted, accepted_domains=ACCEPTED)


@pytest.mark.parametrize(
    ("arg", "local", "domain"),
    [
        ("<user@example.com>", "user", "example.com"),
        (" <User.Name+tag@Example.COM>", "User.Name+tag", "Example.COM"),
        ("user@example.com", "user", "example.com"),
        ('<"john smith"@example.com>', '"john smith"', "example.com"),
        ('<"a>b"@example.com>', '"a>b"', "example.com"),
        ("<user@[192.0.2.1]>", "user", "[192.0.2.1]"),
        ("<user@[IPv6:2001:db8::1]>", "user", "[IPv6:2001:db8::1]"),
        ("<user@example.com.>", "user", "example.com."),
        ("<postmaster>", "postmaster", ""),
    ],
)
def test_it_parses_recipient_paths_as_given(arg, local, domain):
    mailbox = rcpt(arg)
    assert (mailbox.local, mailbox.domain) == (local, domain)


@pytest.mark.parametrize(
    "arg",
    [
        "<>",
        "<user@example.com",
        "<user@example.com>junk",
        "<user@@example.com>",
        "<a@b@example.com>",
        "<user@exa mple.com>",
        "<user@-->",
        "<user@[300.1.1.1]>",
        "<us er@example.com>",
        '<"unterminated@example.com>',
        "<@example.com>",
        "<user@>",
        "<user@ex\x00ample.com>",
        "<user@example.com\r>",
    ],
)
def test_it_refuses_malformed_recipients_with_a_syntax_reply(arg):
    with pytest.raises(Refused) as refused:
        rcpt(arg)
    assert refused.value.reply == policy.BAD_RECIPIENT_SYNTAX


def test_it_needs_smtputf8_for_a_non_ascii_address():
    with pytest.raises(Refused) as refused:
        rcpt("<jöran@exämple.com>")
    assert refused.value.reply == policy.RECIPIENT_NEEDS_SMTPUTF8
    assert rcpt("<jöran@exämple.com>", utf8=True).domain == "exämple.com"


def test_it_refuses_undecodable_bytes_even_with_smtputf8():
    with pytest.raises(Refused):
        rcpt("<j\udcf6ran@example.com>", utf8=True)


def test_it_accepts_the_null_sender_and_ignores_a_source_route_in_mail():
    assert policy.parse_mail("<>", extended=True, max_size=100) == (None, policy.MailParams())
    sender, _ = policy.parse_mail(
        "<@a.example,@b.example:user@c.example>", extended=True, max_size=100
    )
    assert sender == Mailbox("user", "c.example")


def test_it_refuses_a_sender_without_a_domain():
    with pytest.raises(Refused) as refused:
        policy.parse_mail("<root>", extended=True, max_size=100)
    assert refused.value.reply == policy.SENDER_NOT_FQDN


def test_it_parses_every_mail_parameter_and_keeps_the_envid_case():
    _, params = policy.parse_mail(
        "<a@example.org> size=1000 body=8bitmime SMTPUTF8 ret=hdrs ENVID=Abc+2Bdef",
        extended=True,
        max_size=2000,
    )
    assert params == policy.MailParams(
        size=1000, body="8BITMIME", smtputf8=True, ret="HDRS", envid="Abc+2Bdef"
    )


@pytest.mark.parametrize(
    ("params", "reply"),
    [
        ("SIZE=2001", policy.MESSAGE_TOO_BIG),
        ("SIZE=abc", policy.BAD_PARAMETER.format(name="SIZE")),
        ("BODY=BINARYMIME", policy.BAD_PARAMETER.format(name="BODY")),
        ("SMTPUTF8=yes", policy.BAD_PARAMETER.format(name="SMTPUTF8")),
        ("RET=ALL", policy.BAD_PARAMETER.format(name="RET")),
        ("ENVID=a+zz", policy.BAD_PARAMETER.format(name="ENVID")),
        ("ENVID=" + "x" * 101, policy.BAD_PARAMETER.format(name="ENVID")),
        ("RET=FULL RET=HDRS", policy.DUPLICATE_PARAMETER.format(name="RET")),
        ("AUTH=<>", policy.UNKNOWN_PARAMETER.format(name="AUTH")),
        ("SIZE=", policy.PARAMETER_SYNTAX),
        ("=x", policy.PARAMETER_SYNTAX),
    ],
)
def test_it_refuses_bad_mail_parameters(params, reply):
    with pytest.raises(Refused) as refused:
        policy.parse_mail(f"<a@example.org> {params}", extended=True, max_size=2000)
    assert refused.value.reply == reply


def test_it_refuses_parameters_after_helo():
    with pytest.raises(Refused) as refused:
        policy.parse_mail("<a@example.org> SIZE=10", extended=False, max_size=2000)
    assert refused.value.reply == policy.NO_PARAMETERS_WITH_HELO


def test_it_parses_notify_and_orcpt_and_keeps_the_orcpt_case():
    _, params = policy.parse_rcpt(
        "<b@example.net> notify=failure,delay,FAILURE ORCPT=rfc822;Bob+2Bx@Example.NET",
        extended=True,
        utf8=False,
    )
    assert params == policy.RcptParams(notify="FAILURE,DELAY", orcpt="rfc822;Bob+2Bx@Example.NET")
    _, params = policy.parse_rcpt(
        "<b@example.net> NOTIFY=never ORCPT=utf-8;j\\x{00F6}ran@example.net",
        extended=True,
        utf8=False,
    )
    assert params == policy.RcptParams(notify="NEVER", orcpt="utf-8;j\\x{00F6}ran@example.net")


@pytest.mark.parametrize(
    "params",
    [
        "NOTIFY=NEVER,SUCCESS",
        "NOTIFY=SOMETIMES",
        "NOTIFY=",
        "ORCPT=b@example.net",
        "ORCPT=rfc822;",
        "ORCPT=rfc822;a+zzb",
        "ORCPT=rfc822;" + "x" * 500,
        "ORCPT=utf-8;jöran@example.net",
    ],
)
def test_it_refuses_bad_rcpt_parameters(params):
    with pytest.raises(Refused):
        policy.parse_rcpt(f"<b@example.net> {params}", extended=True, utf8=False)


# The probes of nmap's smtp-open-relay script, and the other classic routing tricks.
ROUTING_TRICKS = [
    "<user%example.com@relay.test>",
    "<user%example.com@[192.0.2.1]>",
    "<example.com!user>",
    "<example.com!user@relay.test>",
    "<@relay.test:user@example.com>",
    "<@[192.0.2.1]:user@example.com>",
    "<@a.test,@relay.test:user@relay.test>",
    '<"user@example.com">',
    '<"user@example.com"@relay.test>',
    '<"user%example.com">',
    '<"user%example.com"@relay.test>',
    '<"example.com!user"@relay.test>',
    '<"user\\@example.com"@relay.test>',
]


@pytest.mark.parametrize("arg", ROUTING_TRICKS)
@pytest.mark.parametrize("trusted", [False, True])
def test_it_refuses_sender_specified_routing_for_every_client(arg, trusted):
    assert refusal_for(arg, trusted=trusted) == policy.ROUTING_DENIED


def test_it_relays_to_other_domains_only_for_trusted_clients():
    assert refusal_for("<user@example.com>", trusted=False) == policy.RELAY_DENIED
    assert refusal_for("<user@[192.0.2.1]>", trusted=False) == policy.RELAY_DENIED
    assert refusal_for("<user@example.com>", trusted=True) is None


def test_it_accepts_its_own_domains_from_anyone_in_any_case():
    assert refusal_for("<user@relay.test>", trusted=False) is None
    assert refusal_for("<User@RELAY.Test.>", trusted=False) is None
    assert refusal_for("<user@sub.relay.test>", trusted=False) == policy.RELAY_DENIED


def test_it_matches_accepted_domains_in_unicode_and_in_a_labels():
    accepted = frozenset({policy.domain_key("Exämple.com")})
    for arg in ("<jöran@exämple.com>", "<joran@XN--EXMPLE-CUA.com>"):
        recipient = rcpt(arg, utf8=True)
        assert policy.recipient_refusal(recipient, trusted=False, accepted_domains=accepted) is None


def test_it_matches_accepted_domains_in_every_spelling_of_their_one_form():
    # Full-width letters, ideographic full stops, case, a final dot (issue #9).
    accepted = frozenset({policy.domain_key("example.test")})
    for arg in (
        "<victim@ｅｘａｍｐｌｅ.test>",
        "<victim@EXAMPLE\u3002ｔｅｓｔ>",
        "<victim@Example.Test.>",
    ):
        recipient = rcpt(arg, utf8=True)
        assert policy.recipient_refusal(recipient, trusted=False, accepted_domains=accepted) is None
    assert rcpt("<victim@ｅｘａｍｐｌｅ.test>", utf8=True).address == "victim@example.test"


def test_it_refuses_a_domain_without_an_idna_form_with_553():
    with pytest.raises(policy.Refused) as info:
        rcpt("<u@xn--zz.test>")
    assert info.value.reply == policy.BAD_RECIPIENT_DOMAIN
    assert policy.BAD_RECIPIENT_DOMAIN.startswith("553 5.1.3 ")
    assert policy.BAD_SENDER_DOMAIN.startswith("553 5.1.7 ")


def test_it_refuses_a_recipient_without_a_domain_for_every_client():
    assert refusal_for("<postmaster>", trusted=True) == policy.RECIPIENT_NOT_FQDN
    assert policy.RECIPIENT_NOT_FQDN.startswith("553 5.1.3 ")


@pytest.mark.parametrize(
    ("host", "trusted"),
    [
        ("10.1.2.3", True),
        ("::ffff:10.1.2.3", True),
        ("2001:db8::5", True),
        ("fe80::1%eth0", False),
        ("192.0.2.1", False),
        (None, False),
        ("not-an-ip", False),
    ],
)
def test_it_trusts_only_clients_in_the_relay_networks(host, trusted):
    assert policy.is_trusted(policy.client_ip(host), NETWORKS) is trusted


@pytest.mark.parametrize(
    ("reply", "enhanced"),
    [
        ("250 OK", "250 2.0.0 OK"),
        ("221 Bye", "221 2.0.0 Bye"),
        ("503 Error: need RCPT command", "503 5.5.1 Error: need RCPT command"),
        ('500 Error: command "X" not recognized', '500 5.5.2 Error: command "X" not recognized'),
        ("552 Error: Too much mail data", "552 5.3.4 Error: Too much mail data"),
        ("502 EXPN not implemented", policy.EXPN_DISABLED),
        (
            "502 5.5.1 Too many unrecognized commands, goodbye.",
            "502 5.5.1 Too many unrecognized commands, goodbye.",
        ),
        ("354 End data with <CR><LF>.<CR><LF>", "354 End data with <CR><LF>.<CR><LF>"),
        ("499 odd", "499 4.0.0 odd"),
    ],
)
def test_it_gives_aiosmtpd_replies_an_enhanced_code(reply, enhanced):
    assert enhance(reply) == enhanced


def test_every_named_reply_carries_an_enhanced_code():
    exempt = {"START_DATA", "HELO_SYNTAX", "EHLO_SYNTAX"}
    for name in dir(policy):
        value = getattr(policy, name)
        if name.isupper() and isinstance(value, str) and name not in exempt:
            assert enhance(value) == value, name
