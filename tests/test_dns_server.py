"""The loopback DNS server fixture answers like a real authoritative server."""

from __future__ import annotations

import dns.exception
import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import pytest

from tests.support.dns import DNSTestServer


def ask(server: DNSTestServer, name: str, rdtype: str, *, tcp: bool = False, timeout=2.0):
    query = dns.message.make_query(name, rdtype)
    send = dns.query.tcp if tcp else dns.query.udp
    return send(query, server.address, port=server.port, timeout=timeout)


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
def test_it_serves_mx_records_over_udp_and_tcp(dns_server, tcp):
    dns_server.mx("example.com", [(10, "mx1.example.com"), (20, "mx2.example.com")])

    response = ask(dns_server, "example.com", "MX", tcp=tcp)

    assert response.rcode() == dns.rcode.NOERROR
    assert response.flags & dns.flags.AA
    records = sorted((rr.preference, rr.exchange.to_text()) for rr in response.answer[0])
    assert records == [(10, "mx1.example.com."), (20, "mx2.example.com.")]
    assert dns_server.queried("example.com", "MX")[0].protocol == ("tcp" if tcp else "udp")


def test_it_answers_nxdomain_with_the_aa_flag_for_unknown_names(dns_server):
    response = ask(dns_server, "nowhere.example", "MX")

    assert response.rcode() == dns.rcode.NXDOMAIN
    assert response.flags & dns.flags.AA
    assert response.authority[0].rdtype == dns.rdatatype.SOA


def test_it_answers_nodata_for_a_known_name_without_that_type(dns_server):
    dns_server.a("host.example", "127.0.0.2")

    response = ask(dns_server, "host.example", "MX")

    assert response.rcode() == dns.rcode.NOERROR
    assert response.answer == []
    assert response.authority[0][0].minimum == 0  # negative TTL 0: nothing cached


def test_it_treats_a_parent_of_a_configured_name_as_existing(dns_server):
    dns_server.a("mx1.sub.example", "127.0.0.2")

    assert ask(dns_server, "sub.example", "A").rcode() == dns.rcode.NOERROR


def test_it_serves_a_and_aaaa(dns_server):
    dns_server.a("host.example", "127.0.0.2", "127.0.0.3")
    dns_server.aaaa("host.example", "::1")

    a = ask(dns_server, "host.example", "A")
    aaaa = ask(dns_server, "host.example", "AAAA")

    assert sorted(rr.address for rr in a.answer[0]) == ["127.0.0.2", "127.0.0.3"]
    assert [rr.address for rr in aaaa.answer[0]] == ["::1"]


def test_it_serves_a_null_mx_as_preference_0_and_the_root(dns_server):
    dns_server.null_mx("nomail.example")

    (rr,) = ask(dns_server, "nomail.example", "MX").answer[0]

    assert (rr.preference, rr.exchange.to_text()) == (0, ".")


def test_it_follows_a_cname_inside_the_zone(dns_server):
    dns_server.cname("alias.example", "host.example")
    dns_server.a("host.example", "127.0.0.2")

    response = ask(dns_server, "alias.example", "A")

    assert [rrset.rdtype for rrset in response.answer] == [dns.rdatatype.CNAME, dns.rdatatype.A]


def test_it_answers_servfail_without_the_aa_flag(dns_server):
    dns_server.servfail("broken.example")

    response = ask(dns_server, "broken.example", "MX")

    assert response.rcode() == dns.rcode.SERVFAIL
    assert not response.flags & dns.flags.AA


def test_it_can_fail_one_type_only(dns_server):
    dns_server.a("half.example", "127.0.0.2")
    dns_server.servfail("half.example", "AAAA")

    assert ask(dns_server, "half.example", "A").rcode() == dns.rcode.NOERROR
    assert ask(dns_server, "half.example", "AAAA").rcode() == dns.rcode.SERVFAIL


def test_it_does_not_answer_a_dropped_name(dns_server):
    dns_server.drop("slow.example")

    with pytest.raises(dns.exception.Timeout):
        ask(dns_server, "slow.example", "MX", timeout=0.3)
    assert dns_server.queried("slow.example")


def test_it_starts_each_test_with_an_empty_zone(dns_server):
    assert dns_server.queries == []
    assert ask(dns_server, "example.com", "MX").rcode() == dns.rcode.NXDOMAIN


def test_it_forgets_a_removed_name(dns_server):
    dns_server.servfail("flaky.example")
    dns_server.remove("flaky.example")

    assert ask(dns_server, "flaky.example", "A").rcode() == dns.rcode.NXDOMAIN


def test_dns_settings_points_the_relay_at_the_server(dns_settings, settings):
    assert [f"127.0.0.1:{dns_settings.port}"] == settings.MAILRELAY_DNS_NAMESERVERS
    assert dns_settings.env()["MAILRELAY_DNS_NAMESERVERS"] == dns_settings.nameserver
