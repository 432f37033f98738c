"""The destination policy on its own: which resolved addresses the server connects to.

The resolver is injected, so every address here is what an attacker's DNS
could answer; nothing is fetched. The special-purpose ranges are IANA's IPv4
and IPv6 registries, checked by the policy's own table: the running Python's
``is_global`` differs between patch releases and is not relied on alone.
"""

from __future__ import annotations

import ipaddress

import pytest

from api.images.destinations import DestinationPolicy, RefusedDestination


def _answering(*addresses: str) -> DestinationPolicy:
    return DestinationPolicy(resolver=lambda host, port: list(addresses))


def _refusal(address: str, *allow: str) -> str | None:
    return DestinationPolicy.allowing(allow).refusal(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        # NAT64, the well-known prefix 64:ff9b::/96: judged by the IPv4 address inside.
        ("64:ff9b::7f00:1", "embeds 127.0.0.1, a loopback"),
        ("64:ff9b::a9fe:a9fe", "embeds 169.254.169.254, a link-local"),
        ("64:ff9b::10.0.0.1", "embeds 10.0.0.1, a private"),
        ("64:ff9b::100.100.100.200", "provider's own services"),
        # IPv4-translated, ::ffff:0:0:0/96 (RFC 2765, RFC 6145).
        ("::ffff:0:7f00:1", "embeds 127.0.0.1, a loopback"),
        ("::ffff:0:a9fe:a9fe", "embeds 169.254.169.254, a link-local"),
        # NAT64's local-use prefix: its IPv4 form is the network's own choice.
        ("64:ff9b:1::7f00:1", "local-use"),
        ("64:ff9b:1::808:808", "local-use"),
        # IETF protocol assignments, 192.0.0.0/24, whatever Python's tables say.
        ("192.0.0.8", "IETF protocol assignment"),
        ("192.0.0.9", "IETF protocol assignment"),
        ("192.0.0.10", "IETF protocol assignment"),
        ("192.0.0.170", "IETF protocol assignment"),
        ("64:ff9b::192.0.0.9", "embeds 192.0.0.9"),
        # Documentation, benchmarking, relays and AS112.
        ("3fff::1", "documentation"),
        ("3fff:fff:ffff::1", "documentation"),
        ("2001:db8::1", "documentation"),
        ("192.0.2.1", "documentation"),
        ("198.51.100.7", "documentation"),
        ("203.0.113.9", "documentation"),
        ("198.18.0.1", "benchmarking"),
        ("2001:2::1", "benchmarking"),
        ("192.31.196.1", "AS112"),
        ("192.175.48.1", "AS112"),
        ("2001:4:112::1", "AS112"),
        ("2620:4f:8000::1", "AS112"),
        ("192.52.193.1", "AMT"),
        ("2001:3::1", "AMT"),
        ("192.88.99.1", "6to4 relay"),
        ("2001:1::1", "IETF protocol assignment"),
        ("2001:20::1", "IETF protocol assignment"),
        ("2001:30::1", "IETF protocol assignment"),
        # The rest of the IPv6 registry, and what lies outside global unicast.
        ("100::1", "discard-only"),
        ("5f00::1", "segment routing"),
        ("fec0::1", "site-local"),
        ("ff02::1", "multicast"),
        ("4000::1", "outside"),
        ("::1:0:0:1", "outside"),
        # The IPv4 registry's other entries.
        ("0.1.2.3", "this network"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("239.255.255.250", "multicast"),
        # Every embedding form, judged the same way.
        ("::ffff:192.0.0.9", "embeds 192.0.0.9"),
        ("2002:c000:9::", "embeds 192.0.0.9"),
        ("::192.0.2.1", "embeds 192.0.2.1"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "embeds 192.0.2.45"),  # Teredo (RFC 4380)
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "embeds 127.0.0.1"),  # Teredo to the loopback
    ],
)
def test_special_purpose_and_embedded_addresses_are_refused(address: str, reason: str):
    refusal = _refusal(address)
    assert refusal is not None and reason in refusal, refusal


@pytest.mark.parametrize(
    "address",
    [
        "64:ff9b::808:808",  # 8.8.8.8 through NAT64: how an IPv6-only cluster reaches it
        "64:ff9b::8.8.4.4",
        "::ffff:0:808:808",  # 8.8.8.8, IPv4-translated
        "::ffff:8.8.8.8",
        "2002:808:808::1",  # 6to4 around 8.8.8.8
        "2001:4860:4860::8888",
        "1.1.1.1",
        "192.0.1.1",  # beside 192.0.0.0/24 and 192.0.2.0/24, not in either
        "3fff:1000::1",  # beside 3fff::/20
    ],
)
def test_public_addresses_in_every_form_are_allowed(address: str):
    assert _refusal(address) is None


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("192.0.0.9", "192.0.0.0/24"),
        ("3fff::1", "3fff::/20"),
        ("64:ff9b::a00:1", "10.0.0.0/8"),  # through NAT64, to the network the operator opened
        ("64:ff9b::a00:1", "64:ff9b::/96"),
        ("64:ff9b:1::a00:1", "64:ff9b:1::/48"),
    ],
)
def test_an_allowed_network_opens_a_special_range(address: str, allowed: str):
    assert _refusal(address) is not None
    assert _refusal(address, allowed) is None


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ("64:ff9b::a9fe:a9fe", "resolves to 64:ff9b::a9fe:a9fe, which embeds 169.254.169.254"),
        ("::ffff:0:7f00:1", "resolves to ::ffff:0:7f00:1, which embeds 127.0.0.1, a loopback"),
        ("192.0.0.8", "resolves to 192.0.0.8, an IETF protocol assignment"),
        ("3fff::1", "resolves to 3fff::1, a documentation"),
    ],
)
def test_a_name_resolving_to_a_special_address_is_refused_naming_it(answer: str, words: str):
    with pytest.raises(RefusedDestination) as refused:
        _answering("93.184.216.34", answer).address_for("images.example.com", 443)
    assert str(refusal := refused.value).startswith("images.example.com ") and words in str(refusal)


def test_a_name_resolving_through_nat64_to_a_public_address_is_connected_to():
    policy = _answering("64:ff9b::5db8:d822")  # 93.184.216.34
    assert policy.address_for("images.example.com", 443) == "64:ff9b::5db8:d822"
