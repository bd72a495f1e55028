"""Webhook destinations are an allow-list: whatever way a URL spells a non-global address
(IPv4 in decimal, octal, hex or short forms; IPv6 plain, exploded, with an embedded IPv4,
a zone id; brackets, userinfo, trailing dots, full-width digits), it is refused, and so is
every IPv6 range that can carry an IPv4 address. Spellings of a global address are accepted
as that very address (the checked address is the one connected to)."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_batch.core.config import Settings
from llm_batch.infra.webhook_destinations import DestinationRefused, check_destination, refusal
from tests.fuzzing import examples

DEFAULTS = Settings(webhook_allowed_hosts=[], webhook_allow_public=True)
NON_GLOBAL_V4 = ["0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
                 "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
                 "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4"]
NON_GLOBAL_V6 = ["::1/128", "::/128", "fe80::/10", "fc00::/7", "ff00::/8", "2001:db8::/32", "100::/64", "fec0::/10"]
# Ranges that embed an IPv4 address (any, a public one too): refused whatever they carry.
TRANSITION_V6 = ["2002::/16", "64:ff9b::/96", "64:ff9b:1::/48", "::ffff:0:0/96", "::/96", "2001::/32"]


def unresolvable(host: str, port: int) -> list[str]:
    raise OSError("Name or service not known")


def numeric(host: str, port: int) -> list[str]:
    """What the system resolver answers for a host it reads as a number, without DNS."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    return [info[4][0] for info in infos]


def in_network(cidr: str) -> st.SearchStrategy:
    network = ipaddress.ip_network(cidr)
    return st.integers(0, network.num_addresses - 1).map(lambda i: network[i])


def number(value: int) -> st.SearchStrategy[str]:
    """`value` as inet_aton reads a number: decimal, octal (leading 0), hex (0x/0X, padded)."""
    return st.one_of(
        st.just(str(value)),
        st.integers(1, 3).map(lambda zeros: "0" * zeros + format(value, "o")),
        st.tuples(st.sampled_from(["0x", "0X"]), st.integers(0, 3), st.booleans()).map(
            lambda t: t[0] + "0" * t[1] + (format(value, "X") if t[2] else format(value, "x"))),
    )


def v4_spelled(ip: ipaddress.IPv4Address) -> st.SearchStrategy[str]:
    """Every inet_aton form of `ip`: a.b.c.d, a.b.cd, a.bcd, abcd, each part in any base."""
    a, b, c, d = ip.packed
    groupings = [[a, b, c, d], [a, b, c << 8 | d], [a, b << 16 | c << 8 | d], [int(ip)]]
    return st.sampled_from(groupings).flatmap(lambda parts: st.tuples(*map(number, parts))).map(".".join)


def v6_spelled(ip: ipaddress.IPv6Address) -> st.SearchStrategy[str]:
    embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    head = ip.exploded.rsplit(":", 2)[0]
    return st.sampled_from([ip.compressed, ip.exploded, ip.compressed.upper(), ip.exploded.upper(),
                            f"{head}:{embedded}", str(ipaddress.IPv6Address(f"{head}:{embedded}"))])


def embedding(v4: ipaddress.IPv4Address) -> st.SearchStrategy[ipaddress.IPv6Address]:
    """`v4` inside each IPv6 transition form (6to4, NAT64, mapped, compatible, Teredo)."""
    n = int(v4)
    return st.one_of(
        st.integers(0, 2**80 - 1).map(lambda rest: ipaddress.IPv6Address(0x2002 << 112 | n << 80 | rest)),
        st.just(ipaddress.IPv6Address(0x64FF9B << 96 | n)),
        st.integers(0, 2**48 - 1).map(lambda rest: ipaddress.IPv6Address((0x64FF9B0001 << 80) | rest << 32 | n)),
        st.just(ipaddress.IPv6Address(0xFFFF << 32 | n)),
        st.just(ipaddress.IPv6Address(n)),
        st.integers(0, 2**64 - 1).map(lambda rest: ipaddress.IPv6Address(0x20010000 << 96 | n << 64 | rest)),
    )


def full_width(text: str) -> str:
    return "".join(chr(ord(ch) - ord("0") + 0xFF10) if ch.isdigit() else ch for ch in text)


any_v4 = st.sampled_from(NON_GLOBAL_V4 + ["0.0.0.0/0"]).flatmap(in_network)
non_global_v4 = st.sampled_from(NON_GLOBAL_V4).flatmap(in_network)
non_global_v6 = st.one_of(st.sampled_from(NON_GLOBAL_V6 + TRANSITION_V6).flatmap(in_network), any_v4.flatmap(embedding))
hosts = st.one_of(
    non_global_v4.flatmap(v4_spelled).flatmap(lambda h: st.sampled_from([h, h + ".", h + "..", full_width(h)])),
    non_global_v4.map(lambda ip: f"[{ip}]"),  # an IPv4 address in IPv6 brackets
    non_global_v6.flatmap(v6_spelled).flatmap(
        lambda h: st.sampled_from([f"[{h}]", f"[{h}%25eth0]", f"[{h}%eth0]", f"[{h}%251]", h])),
)


def url(host: str) -> st.SearchStrategy[str]:
    return st.tuples(
        st.sampled_from(["http", "https", "HTTP"]),
        st.sampled_from(["", "user@", "user:pw@", "hooks.example.com@"]),
        st.sampled_from(["", ":80", ":8080", ":443"]),
        st.sampled_from(["/", "/hook", "/hook?x=1", ""]),
    ).map(lambda t: f"{t[0]}://{t[1]}{host}{t[2]}{t[3]}")


@settings(max_examples=examples(1500), deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(target=hosts.flatmap(url))
@pytest.mark.parametrize("resolve", [unresolvable, numeric])
def test_no_spelling_of_a_non_global_address_is_accepted(resolve, target):
    with pytest.raises(DestinationRefused) as refused:
        check_destination(target, DEFAULTS, resolve, unresolved_ok=True)
    assert target[:60] in str(refused.value)


@settings(max_examples=examples(300), deadline=None, database=None)
@given(data=st.data())
def test_spellings_of_a_global_address_are_that_address(data):
    ip = data.draw(in_network("0.0.0.0/0").filter(lambda a: refusal(a) is None))
    host = data.draw(v4_spelled(ip))
    assert check_destination(f"https://{host}/hook", DEFAULTS, unresolvable) == [str(ip)]
    v6 = data.draw(in_network("2000::/3").filter(lambda a: refusal(a) is None))
    assert check_destination(f"https://[{data.draw(v6_spelled(v6))}]:8443/hook", DEFAULTS, unresolvable) == [str(v6)]


@pytest.mark.parametrize(("address", "why"), [
    ("2002:a00:1::1", "6to4"), ("2002:808:808::1", "6to4"), ("64:ff9b::a00:1", "NAT64"),
    ("64:ff9b:1::a00:1", "NAT64"), ("::ffff:8.8.8.8", "IPv4-mapped"), ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
    ("fec0::1", "site-local"), ("ff0e::1", "multicast"), ("224.0.0.251", "multicast"), ("100.64.0.1", "not a public"),
])
def test_transition_site_local_and_multicast_ranges_are_refused_by_name(address, why):
    with pytest.raises(DestinationRefused, match=why):
        check_destination(f"http://{'[' + address + ']' if ':' in address else address}/x", DEFAULTS, unresolvable)


def test_a_name_resolving_to_a_transition_address_is_refused():
    with pytest.raises(DestinationRefused, match=r"2002:a00:1::1 is a 6to4 address \('hooks.example.com' resolves to"):
        check_destination("https://hooks.example.com/x", DEFAULTS, lambda host, port: ["93.184.215.14", "2002:a00:1::1"])


def test_an_admin_may_still_allow_a_non_global_destination():
    allowing = Settings(webhook_allowed_hosts=["127.0.0.1", "fec0::/10"])
    assert check_destination("http://127.0.0.1:9000/x", allowing, unresolvable) == ["127.0.0.1"]
    assert check_destination("http://0x7f.1:9000/x", allowing, unresolvable) == ["127.0.0.1"]
    assert check_destination("http://[fec0::5]/x", allowing, unresolvable) == ["fec0::5"]
    with pytest.raises(DestinationRefused):
        check_destination("http://127.0.0.2/x", allowing, unresolvable)
