"""Routing: transport map, smart host and DNS MX, against a real DNS server on loopback."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured

from delivery.checks import validate_routing_settings
from delivery.route.dns import make_resolver, parse_nameserver
from delivery.route.routing import (
    NextHop,
    RouteError,
    Router,
    Target,
    link_name,
    lookup_transport,
    order_targets,
    parse_next_hop,
    parse_transports,
    sort_mx,
)
from tests.support.dns import free_udp_port

# --- parsing (pure) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("[10.0.0.5]:2525", NextHop("10.0.0.5", 2525, 0, literal=True)),
        ("[10.0.0.5]", NextHop("10.0.0.5", 25, 0, literal=True)),
        ("[IPv6:2001:DB8::1]", NextHop("2001:db8::1", 25, 0, literal=True)),
        ("[ipv6:2001:db8::1]:587", NextHop("2001:db8::1", 587, 0, literal=True)),
        ("[2001:db8::1]:26", NextHop("2001:db8::1", 26, 0, literal=True)),
        ("[Relay.Example.COM]:587", NextHop("relay.example.com", 587, 0, literal=True)),
        ("relay.example.com", NextHop("relay.example.com", 25, 0, literal=False)),
        ("Relay.Example.COM.:2525", NextHop("relay.example.com", 2525, 0, literal=False)),
        ("10.0.0.5:2526", NextHop("10.0.0.5", 2526, 0, literal=True)),
        ("  mail_gw.internal  ", NextHop("mail_gw.internal", 25, 0, literal=False)),
    ],
)
def test_it_parses_a_next_hop_like_postfix(spec, expected):
    assert parse_next_hop(spec, 25) == (expected,)


def test_it_parses_several_next_hops_in_the_order_written():
    assert parse_next_hop("[10.0.0.5]:25 relay.example.net", 25) == (
        NextHop("10.0.0.5", 25, 0, literal=True),
        NextHop("relay.example.net", 25, 1, literal=False),
    )


def test_it_takes_the_default_port_from_settings(settings):
    settings.MAILRELAY_REMOTE_SMTP_PORT = 2500
    assert parse_next_hop("[10.0.0.5]") == (NextHop("10.0.0.5", 2500, 0, literal=True),)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty next hop"),
        ("[10.0.0.5", "bad brackets"),
        ("10.0.0.5]", "bad brackets"),
        ("[10.0.0.5]x", "bad brackets"),
        ("[]", "is not a host name"),
        ("[IPv6:10.0.0.5]", "is not an IPv6 address"),
        ("relay.example.com:0", "port '0' is not a number from 1 to 65535"),
        ("relay.example.com:65536", "port '65536'"),
        ("relay.example.com:smtp", "port 'smtp'"),
        ("relay.example.com:", "port ''"),
        ("[10.0.0.5]:", "port ''"),
        ("2001:db8::1", "an IPv6 address must be in brackets"),
        ("bad!host", "is not a host name"),
        ("-bad.example", "is not a host name"),
        ("a..b", "is not a host name"),
    ],
)
def test_it_rejects_a_bad_next_hop_with_a_clear_message(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        parse_next_hop(spec, 25)


def test_it_parses_a_transport_map():
    transports = parse_transports(
        "Example.com=[10.0.0.5]:2525, .example.com = relay.example.net,\nother.org=mx.other.org",
        25,
    )

    assert transports == {
        "example.com": (NextHop("10.0.0.5", 2525, 0, literal=True),),
        ".example.com": (NextHop("relay.example.net", 25, 0, literal=False),),
        "other.org": (NextHop("mx.other.org", 25, 0, literal=False),),
    }


def test_transport_map_keys_are_parsed_into_the_one_form_of_a_domain():
    transports = parse_transports(
        "ＥＸＡＭＰＬＥ\u3002test=[10.0.0.5],.Bücher.DE.=[10.0.0.6],xn--EXMPLE-cua.org=[10.0.0.7]",
        25,
    )

    assert list(transports) == ["example.test", ".xn--bcher-kva.de", "xn--exmple-cua.org"]


def test_an_empty_transport_map_is_empty():
    assert parse_transports(" , ", 25) == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("example.com", "expected domain=next-hop"),
        ("=[10.0.0.5]", "is not a domain"),
        (".=[10.0.0.5]", "is not a domain"),
        ("exa mple.com=[10.0.0.5]", "is not a domain"),
        ("user@example.com=[10.0.0.5]", "is not a domain"),
        ("a..example.com=[10.0.0.5]", "is not a domain"),
        ("example.com=", "empty next hop"),
        ("example.com=[10.0.0.5]:99999", "port '99999'"),
        ("example.com=[10.0.0.5],EXAMPLE.com.=[10.0.0.6]", "example.com is mapped twice"),
        ("exämple.com=[10.0.0.5],xn--exmple-cua.com=[10.0.0.6]", "cua.com is mapped twice"),
        ("ｅｘａｍｐｌｅ.com=[10.0.0.5],example.com=[10.0.0.6]", "example.com is mapped twice"),
        ("xn--zz.com=[10.0.0.5]", "is not a domain"),
        ("☃.com=[10.0.0.5]", "is not a domain"),
        (".ab--ü.com=[10.0.0.5]", "is not a domain"),
    ],
)
def test_it_rejects_a_bad_transport_map_naming_the_entry(text, message):
    with pytest.raises(ValueError, match="transport ") as info:
        parse_transports(text, 25)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("domain", "key"),
    [
        ("example.com", "example.com"),
        ("a.example.com", ".example.com"),
        ("b.a.example.com", ".a.example.com"),
        ("c.b.example.com", ".example.com"),
        ("example.org", None),
        ("notexample.com", None),
    ],
)
def test_it_looks_up_the_exact_domain_then_the_closest_parent(domain, key):
    transports = parse_transports(
        "example.com=[10.0.0.1],.example.com=[10.0.0.2],.a.example.com=[10.0.0.3]", 25
    )
    found = lookup_transport(transports, domain)
    assert (found[0] if found else None) == key


def test_a_dotted_key_does_not_match_the_domain_itself():
    transports = parse_transports(".example.com=[10.0.0.2]", 25)
    assert lookup_transport(transports, "example.com") is None


def test_validate_routing_settings_names_the_bad_setting(settings):
    settings.MAILRELAY_TRANSPORTS = "example.com"
    with pytest.raises(ImproperlyConfigured, match="^MAILRELAY_TRANSPORTS: transport"):
        validate_routing_settings()
    settings.MAILRELAY_TRANSPORTS = ""
    settings.MAILRELAY_SMART_HOST = "[relay"
    with pytest.raises(ImproperlyConfigured, match="^MAILRELAY_SMART_HOST: "):
        validate_routing_settings()
    settings.MAILRELAY_SMART_HOST = ""
    settings.MAILRELAY_DNS_NAMESERVERS = ["dns.example"]
    with pytest.raises(ImproperlyConfigured, match="^MAILRELAY_DNS_NAMESERVERS: "):
        validate_routing_settings()
    settings.MAILRELAY_DNS_NAMESERVERS = ["127.0.0.1:5353"]
    validate_routing_settings()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("192.0.2.53", ("192.0.2.53", 53)),
        ("192.0.2.53:5353", ("192.0.2.53", 5353)),
        ("::1", ("::1", 53)),
        ("[::1]:5353", ("::1", 5353)),
        ("[2001:DB8::53]", ("2001:db8::53", 53)),
    ],
)
def test_it_parses_a_nameserver(spec, expected):
    assert parse_nameserver(spec) == expected


@pytest.mark.parametrize(
    "spec", ["dns.example", "[::1", "192.0.2.53:0", "192.0.2.53:x", "[1.2.3.4]"]
)
def test_it_rejects_a_bad_nameserver(spec):
    with pytest.raises(ValueError, match="nameserver"):
        parse_nameserver(spec)


def test_make_resolver_uses_the_settings(settings):
    settings.MAILRELAY_DNS_NAMESERVERS = ["127.0.0.1:5353", "[::1]:5354"]
    settings.MAILRELAY_DNS_TIMEOUT = timedelta(seconds=3)

    resolver = make_resolver()

    assert [(ns.address, ns.port) for ns in resolver.nameservers] == [
        ("127.0.0.1", 5353),
        ("::1", 5354),
    ]
    assert resolver.lifetime == 3.0


# --- ordering (pure) ------------------------------------------------------------


def hop(host: str, preference: int = 0, port: int = 25, literal: bool = False) -> NextHop:
    return NextHop(host, port, preference, literal)


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([hop("b", 20), hop("a", 10)], ["a", "b"]),
        ([hop("c", 10), hop("b", 10), hop("a", 5)], ["a", "b", "c"]),
        ([hop("z", 0), hop("y", 65535)], ["z", "y"]),
        ([], []),
    ],
)
def test_sort_mx_without_rng_orders_by_preference_then_name(records, expected):
    assert [h.host for h in sort_mx(records)] == expected


@pytest.mark.parametrize(
    ("seed", "expected"),
    [
        # the seeded shuffles of the tie between b and c (a and d stay put)
        (0, ["a", "b", "c", "d"]),
        (1, ["a", "c", "b", "d"]),
    ],
)
def test_sort_mx_with_rng_shuffles_only_among_equals(seed, expected):
    records = [hop("d", 30), hop("c", 20), hop("b", 20), hop("a", 10)]
    assert [h.host for h in sort_mx(records, random.Random(seed))] == expected


def test_sort_mx_does_not_depend_on_the_order_dns_answered():
    records = [hop("c", 10), hop("a", 10), hop("b", 10), hop("x", 5)]
    for permutation in (records, records[::-1], records[1:] + records[:1]):
        assert sort_mx(permutation, random.Random(7)) == sort_mx(records, random.Random(7))


def test_link_name_joins_hosts_and_brackets_literals():
    hosts = [hop("mx1.example.com", 10), hop("10.0.0.5", 0, 2525, literal=True)]
    assert link_name(hosts) == "mx1.example.com:25,[10.0.0.5]:2525"


def test_a_very_long_link_name_is_cut_with_a_digest():
    hosts = [hop(f"mx{i}." + "x" * 60 + ".example", i) for i in range(40)]
    name = link_name(hosts)
    assert len(name) <= 1024
    assert name != link_name(hosts[:-1])


# --- routing through DNS --------------------------------------------------------


@pytest.fixture
def router(dns_settings):
    return Router.from_settings()


def test_it_routes_to_the_mx_hosts_in_ascending_preference(router, dns_settings):
    dns_settings.mx(
        "example.com",
        [(30, "mx3.example.com"), (10, "MX1.example.com."), (20, "mx2.example.com")],
    )

    route = router.route("Example.COM.")

    assert route.delivery_type == "dns_mx"
    assert route.queue_name == "example.com"
    assert route.hosts == (
        NextHop("mx1.example.com", 25, 10),
        NextHop("mx2.example.com", 25, 20),
        NextHop("mx3.example.com", 25, 30),
    )
    assert route.link_name == "mx1.example.com:25,mx2.example.com:25,mx3.example.com:25"


def test_mx_hosts_use_the_remote_smtp_port(dns_settings, settings):
    settings.MAILRELAY_REMOTE_SMTP_PORT = 2525
    dns_settings.mx("example.com", [(10, "mx1.example.com")])

    route = Router.from_settings().route("example.com")

    assert route.hosts == (NextHop("mx1.example.com", 2525, 10),)


def test_two_domains_behind_the_same_mx_hosts_share_a_link(router, dns_settings):
    dns_settings.mx("one.example", [(10, "mx1.hoster.example"), (10, "mx2.hoster.example")])
    dns_settings.mx("two.example", [(10, "mx2.hoster.example"), (10, "mx1.hoster.example")])

    one, two = router.route("one.example"), router.route("two.example")

    assert one.queue_name != two.queue_name
    assert one.link_name == two.link_name == "mx1.hoster.example:25,mx2.hoster.example:25"


def test_domains_with_different_mx_hosts_get_different_links(router, dns_settings):
    dns_settings.mx("one.example", [(10, "mx1.hoster.example")])
    dns_settings.mx("two.example", [(10, "mx2.hoster.example")])

    assert router.route("one.example").link_name != router.route("two.example").link_name


def test_a_domain_without_mx_is_its_own_mail_host(router, dns_settings):
    dns_settings.a("example.com", "127.0.0.2")

    route = router.route("example.com")

    # reached by its address record, never looked up for MX again: a literal host
    assert route.hosts == (NextHop("example.com", 25, 0, literal=True),)
    assert route.link_name == "[example.com]:25"
    assert [q.qtype for q in dns_settings.queried("example.com")] == ["MX", "A"]


def test_an_ipv6_only_domain_without_mx_is_its_own_mail_host(router, dns_settings):
    dns_settings.aaaa("example.com", "::1")

    assert router.route("example.com").hosts == (NextHop("example.com", 25, 0, literal=True),)


def test_a_domain_with_neither_mx_nor_address_fails_permanently(router, dns_settings):
    dns_settings.exists("example.com")

    with pytest.raises(RouteError) as info:
        router.route("example.com")

    assert (info.value.permanent, info.value.enhanced) == (True, "5.1.2")
    assert (
        info.value.text == "domain example.com has no MX, A or AAAA record: it cannot receive mail"
    )


def test_a_null_mx_fails_permanently(router, dns_settings):
    dns_settings.null_mx("nomail.example")
    dns_settings.a("nomail.example", "127.0.0.2")  # an address does not revive it

    with pytest.raises(RouteError) as info:
        router.route("nomail.example")

    assert (info.value.permanent, info.value.enhanced) == (True, "5.1.10")
    assert info.value.text == "domain nomail.example has a null MX (RFC 7505): it accepts no mail"


def test_a_null_mx_beside_real_mx_records_is_ignored(router, dns_settings):
    dns_settings.mx("odd.example", [(0, "."), (10, "mx1.odd.example")])

    assert router.route("odd.example").hosts == (NextHop("mx1.odd.example", 25, 10),)


def test_a_domain_that_does_not_exist_fails_permanently(router, dns_settings):
    with pytest.raises(RouteError) as info:
        router.route("nosuch.example")

    assert (info.value.permanent, info.value.enhanced) == (True, "5.1.2")
    assert info.value.text == "domain nosuch.example does not exist (DNS answered NXDOMAIN)"


def test_servfail_is_a_temporary_failure(router, dns_settings):
    dns_settings.servfail("broken.example")

    with pytest.raises(RouteError) as info:
        router.route("broken.example")

    assert (info.value.permanent, info.value.enhanced) == (False, "4.4.3")
    assert info.value.text.startswith("DNS lookup of MX records for broken.example failed (")
    assert "SERVFAIL" in info.value.text


def test_servfail_of_the_implicit_mx_address_lookup_is_temporary(router, dns_settings):
    dns_settings.exists("half.example")
    dns_settings.servfail("half.example", "A")

    with pytest.raises(RouteError) as info:
        router.route("half.example")

    assert (info.value.permanent, info.value.enhanced) == (False, "4.4.3")


def test_a_dns_timeout_is_a_temporary_failure(dns_settings, settings):
    settings.MAILRELAY_DNS_TIMEOUT = timedelta(seconds=0.5)
    dns_settings.drop("slow.example")

    with pytest.raises(RouteError) as info:
        Router.from_settings().route("slow.example")

    assert (info.value.permanent, info.value.enhanced) == (False, "4.4.3")
    assert "timed out after 0.5 s" in info.value.text


def test_no_nameserver_answering_is_a_temporary_failure(dns_settings, settings):
    settings.MAILRELAY_DNS_NAMESERVERS = [f"127.0.0.1:{free_udp_port()}"]
    settings.MAILRELAY_DNS_TIMEOUT = timedelta(seconds=0.5)

    with pytest.raises(RouteError) as info:
        Router.from_settings().route("example.com")

    assert (info.value.permanent, info.value.enhanced) == (False, "4.4.3")


@pytest.mark.parametrize(
    "domain", ["", "a..example", "x" * 64 + ".example", "xn--zz.example", "☃.example"]
)
def test_an_invalid_domain_fails_permanently(router, domain):
    with pytest.raises(RouteError) as info:
        router.route(domain)

    assert (info.value.permanent, info.value.enhanced) == (True, "5.1.3")


def test_an_address_literal_domain_is_its_own_next_hop(router, dns_settings):
    route = router.route("[127.0.0.2]")

    assert route.hosts == (NextHop("127.0.0.2", 25, 0, literal=True),)
    assert route.link_name == "[127.0.0.2]:25"
    assert dns_settings.queries == []


# --- transport map and smart host -----------------------------------------------


def test_the_transport_map_wins_over_the_smart_host(dns_settings, settings):
    settings.MAILRELAY_TRANSPORTS = "example.com=[10.0.0.5]:2525"
    settings.MAILRELAY_SMART_HOST = "[10.0.0.9]"
    router = Router.from_settings()

    mapped, other = router.route("example.com"), router.route("example.org")

    assert (mapped.delivery_type, mapped.link_name) == ("transport_map", "[10.0.0.5]:2525")
    assert mapped.hosts == (NextHop("10.0.0.5", 2525, 0, literal=True),)
    assert (other.delivery_type, other.link_name) == ("smart_host", "[10.0.0.9]:25")
    assert other.queue_name == "example.org"
    assert dns_settings.queries == []  # bracketed hosts are never looked up


def test_a_dotted_transport_key_routes_subdomains_only(dns_settings, settings):
    settings.MAILRELAY_TRANSPORTS = ".example.com=[10.0.0.5]"
    dns_settings.mx("example.com", [(10, "mx.example.com")])
    router = Router.from_settings()

    sub = router.route("Deep.Sub.Example.com")

    assert (sub.delivery_type, sub.queue_name) == ("transport_map", "deep.sub.example.com")
    assert router.route("example.com").delivery_type == "dns_mx"


def test_every_spelling_of_a_domain_is_routed_by_its_one_form(dns_settings, settings):
    # Recipient domains are normalised at accept; rows stored before that (and
    # any caller's raw text) are routed by the same form, never by the raw one.
    settings.MAILRELAY_TRANSPORTS = "example.test=[10.0.0.5],.bücher.test=[10.0.0.6]"
    settings.MAILRELAY_SMART_HOST = "[10.0.0.9]"
    router = Router.from_settings()

    for spelling in ("ｅｘａｍｐｌｅ.test", "EXAMPLE\u3002TEST", "example.test."):
        route = router.route(spelling)
        assert (route.delivery_type, route.queue_name) == ("transport_map", "example.test")
    sub = router.route("MX.BÜCHER.test")
    assert (sub.delivery_type, sub.queue_name) == ("transport_map", "mx.xn--bcher-kva.test")
    assert dns_settings.queries == []


def test_dns_is_asked_for_the_a_label_form(router, dns_settings):
    dns_settings.mx("xn--exmple-cua.test", [(10, "mx.example.test")])

    route = router.route("EXÄMPLE.test")

    assert (route.queue_name, route.hosts) == (
        "xn--exmple-cua.test",
        (NextHop("mx.example.test", 25, 10),),
    )


def test_the_smart_host_wins_over_dns(dns_settings, settings):
    settings.MAILRELAY_SMART_HOST = "[relay.example.net]:587"
    dns_settings.mx("example.com", [(10, "mx.example.com")])

    route = Router.from_settings().route("example.com")

    assert route.delivery_type == "smart_host"
    assert route.hosts == (NextHop("relay.example.net", 587, 0, literal=True),)
    assert route.link_name == "[relay.example.net]:587"
    assert dns_settings.queries == []


def test_domains_behind_one_smart_host_share_its_link(dns_settings, settings):
    settings.MAILRELAY_SMART_HOST = "[10.0.0.9]:25"
    router = Router.from_settings()

    assert router.route("a.example").link_name == router.route("b.example").link_name


def test_a_next_hop_without_brackets_is_looked_up_for_mx(dns_settings, settings):
    settings.MAILRELAY_TRANSPORTS = "other.org=relay.other.org:2525"
    dns_settings.mx("relay.other.org", [(20, "mx2.other.org"), (10, "mx1.other.org")])

    route = Router.from_settings().route("other.org")

    assert route.delivery_type == "transport_map"
    assert route.hosts == (NextHop("mx1.other.org", 2525, 10), NextHop("mx2.other.org", 2525, 20))
    assert route.link_name == "mx1.other.org:2525,mx2.other.org:2525"
    assert [(q.name, q.qtype) for q in dns_settings.queries] == [("relay.other.org", "MX")]


def test_a_next_hop_without_brackets_and_without_mx_is_used_itself(dns_settings, settings):
    settings.MAILRELAY_SMART_HOST = "relay.example.net"
    dns_settings.a("relay.example.net", "127.0.0.2")

    route = Router.from_settings().route("example.com")

    assert route.hosts == (NextHop("relay.example.net", 25, 0),)
    assert route.link_name == "relay.example.net:25"


def test_several_next_hops_keep_the_order_written(dns_settings, settings):
    settings.MAILRELAY_SMART_HOST = "[10.0.0.9] relay.example.net"
    dns_settings.mx("relay.example.net", [(10, "mx1.example.net"), (10, "mx2.example.net")])

    route = Router.from_settings().route("example.com")

    assert route.hosts == (
        NextHop("10.0.0.9", 25, 0, literal=True),
        NextHop("mx1.example.net", 25, 1),
        NextHop("mx2.example.net", 25, 1),
    )


def test_a_missing_configured_next_hop_is_a_temporary_failure(dns_settings, settings):
    # A typo in the settings must not bounce mail: it waits for the operator.
    settings.MAILRELAY_SMART_HOST = "relay.invalid"

    with pytest.raises(RouteError) as info:
        Router.from_settings().route("example.com")

    assert (info.value.permanent, info.value.enhanced) == (False, "4.4.4")
    assert info.value.text == (
        "smart host relay.invalid:25 (MAILRELAY_SMART_HOST): relay.invalid does not exist "
        "in DNS (NXDOMAIN); check the setting"
    )


def test_a_dns_failure_for_a_configured_next_hop_names_the_setting(dns_settings, settings):
    settings.MAILRELAY_TRANSPORTS = "example.com=relay.example.net"
    dns_settings.servfail("relay.example.net")

    with pytest.raises(RouteError) as info:
        Router.from_settings().route("example.com")

    assert (info.value.permanent, info.value.enhanced) == (False, "4.4.3")
    assert info.value.text.startswith(
        "transport example.com=relay.example.net:25 (MAILRELAY_TRANSPORTS): DNS lookup of MX"
    )


def test_a_router_built_with_explicit_arguments_needs_no_settings():
    router = Router(transports="example.com=[10.0.0.5]", smart_host="", default_port=25)

    assert router.route("example.com").hosts == (NextHop("10.0.0.5", 25, 0, literal=True),)


# --- delivery targets -----------------------------------------------------------


def test_targets_follow_preference_with_a_before_aaaa(dns_settings):
    dns_settings.a("mx1.example.com", "127.0.0.2", "127.0.0.3")
    dns_settings.aaaa("mx1.example.com", "::1")
    dns_settings.a("mx2.example.com", "127.0.0.4")
    hosts = [hop("mx2.example.com", 20), hop("mx1.example.com", 10)]

    targets, errors = order_targets(hosts, make_resolver())

    assert [(t.host, t.ip) for t in targets] == [
        ("mx1.example.com", "127.0.0.2"),
        ("mx1.example.com", "127.0.0.3"),
        ("mx1.example.com", "::1"),
        ("mx2.example.com", "127.0.0.4"),
    ]
    assert errors == ""


def test_ip_literals_are_targets_without_a_lookup(dns_settings):
    targets, errors = order_targets([hop("10.0.0.5", 0, 2525, literal=True)], make_resolver())

    assert targets == [Target("10.0.0.5", "10.0.0.5", 2525)]
    assert (errors, dns_settings.queries) == ("", [])


def test_a_literal_host_name_is_resolved_for_its_address_not_its_mx(dns_settings):
    dns_settings.a("relay.example.net", "127.0.0.2")

    targets, _ = order_targets([hop("relay.example.net", 0, 587, literal=True)])

    assert targets == [Target("relay.example.net", "127.0.0.2", 587)]
    assert {q.qtype for q in dns_settings.queries} == {"A", "AAAA"}


def test_hosts_of_equal_preference_are_tried_in_random_order(dns_settings):
    dns_settings.a("mx1.example.com", "127.0.0.2")
    dns_settings.a("mx2.example.com", "127.0.0.3")
    dns_settings.a("backup.example.com", "127.0.0.4")
    hosts = [hop("mx1.example.com", 10), hop("mx2.example.com", 10), hop("backup.example.com", 20)]
    resolver = make_resolver()

    orders = set()
    for seed in range(8):
        targets, _ = order_targets(hosts, resolver, random.Random(seed))
        orders.add(tuple(t.host for t in targets))

    assert orders == {
        ("mx1.example.com", "mx2.example.com", "backup.example.com"),
        ("mx2.example.com", "mx1.example.com", "backup.example.com"),
    }


def test_a_host_that_does_not_resolve_is_skipped_and_reported(dns_settings):
    dns_settings.exists("noaddr.example.com")
    dns_settings.a("mx3.example.com", "127.0.0.4")
    hosts = [hop("gone.example.com", 10), hop("noaddr.example.com", 20), hop("mx3.example.com", 30)]

    targets, errors = order_targets(hosts, make_resolver())

    assert targets == [Target("mx3.example.com", "127.0.0.4", 25)]
    assert errors == (
        "gone.example.com: no such host (NXDOMAIN); noaddr.example.com: no A or AAAA record"
    )


def test_a_temporary_failure_is_reported_and_other_addresses_still_used(dns_settings):
    dns_settings.a("mx1.example.com", "127.0.0.2")
    dns_settings.servfail("mx1.example.com", "AAAA")
    dns_settings.servfail("mx2.example.com")

    targets, errors = order_targets(
        [hop("mx1.example.com", 10), hop("mx2.example.com", 20)], make_resolver()
    )

    assert targets == [Target("mx1.example.com", "127.0.0.2", 25)]
    assert "mx1.example.com: DNS lookup of AAAA records for mx1.example.com failed" in errors
    assert "mx2.example.com: DNS lookup of A records for mx2.example.com failed" in errors


def test_an_address_shared_by_two_hosts_is_tried_once(dns_settings):
    dns_settings.a("mx1.example.com", "127.0.0.2")
    dns_settings.a("mx2.example.com", "127.0.0.2")

    targets, _ = order_targets(
        [hop("mx1.example.com", 10), hop("mx2.example.com", 20)], make_resolver()
    )

    assert targets == [Target("mx1.example.com", "127.0.0.2", 25)]


def test_a_route_and_its_targets_work_end_to_end(router, dns_settings):
    dns_settings.mx("example.com", [(10, "mx1.example.com"), (20, "mx2.example.com")])
    dns_settings.a("mx1.example.com", "127.0.0.2")
    dns_settings.a("mx2.example.com", "127.0.0.3")

    route = router.route("example.com")
    targets, errors = order_targets(route.hosts)

    assert [t.ip for t in targets] == ["127.0.0.2", "127.0.0.3"]
    assert errors == ""


def test_the_test_zone_is_never_cached_so_a_changed_record_is_seen(router, dns_settings):
    dns_settings.mx("example.com", [(10, "old.example.com")])
    assert router.route("example.com").hosts[0].host == "old.example.com"

    dns_settings.mx("example.com", [(10, "new.example.com")])

    assert router.route("example.com").hosts[0].host == "new.example.com"


def test_answers_are_cached_for_their_ttl(router, dns_settings):
    dns_settings.ttl = 300
    dns_settings.mx("example.com", [(10, "mx.example.com")])
    router.route("example.com")

    dns_settings.servfail("example.com")

    assert router.route("example.com").hosts[0].host == "mx.example.com"
    assert len(dns_settings.queried("example.com")) == 1


def test_the_transport_map_is_parsed_once_not_per_batch(settings, monkeypatch):
    from delivery.route import routing

    settings.MAILRELAY_TRANSPORTS = "parsed-once.example=[192.0.2.7]:2525"
    settings.MAILRELAY_SMART_HOST = ""
    calls = []
    real = routing.parse_transports

    def counting(text, port):
        calls.append(text)
        return real(text, port)

    monkeypatch.setattr(routing, "parse_transports", counting)
    routing._configured_routes.cache_clear()
    first, second = routing.Router.from_settings(), routing.Router.from_settings()
    assert first.route("parsed-once.example") == second.route("parsed-once.example")
    assert calls == ["parsed-once.example=[192.0.2.7]:2525"]
    settings.MAILRELAY_TRANSPORTS = "parsed-once.example=[192.0.2.8]:2525"
    assert routing.Router.from_settings().route("parsed-once.example").hosts[0].host == "192.0.2.8"
    assert len(calls) == 2
