"""Which addresses an image URL may lead the server to: public ones, and what the operator allows.

A client who can make the server fetch a URL can make it reach what only the
server can reach: its own loopback services, the private network behind it,
the cloud's metadata endpoint. So a destination is resolved once, every
address it resolves to must be public, and the fetch connects to the address
that was checked; a second DNS lookup would let an attacker's name answer
differently the second time. Operators open specific hosts or networks with
``--image-allow``.

Public is decided by the table of IANA's special-purpose ranges below, kept
here because the running Python's ``is_global`` changes between patch
releases, with ``is_global`` as a further check. An IPv6 address that carries
an IPv4 one (NAT64, IPv4-mapped, 6to4, ...) reaches that IPv4 address through
a translator or relay, so it is judged by it: ``64:ff9b::8.8.8.8`` is how an
IPv6-only cluster reaches a public host, ``64:ff9b::127.0.0.1`` its loopback.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]  # host, port -> addresses as text

_IPV4_SPECIAL: tuple[tuple[str, str], ...] = (
    # IANA's IPv4 Special-Purpose Address Registry, plus multicast and the reserved 240/4.
    ("0.0.0.0/8", "a 'this network' address"),  # Linux connects 0.0.0.0 to the loopback
    ("10.0.0.0/8", "a private address"),
    ("100.64.0.0/10", "a shared (CGNAT) address, reserved for the provider's own services"),
    ("127.0.0.0/8", "a loopback address"),
    ("169.254.0.0/16", "a link-local address"),  # the cloud metadata address, 169.254.169.254
    ("172.16.0.0/12", "a private address"),
    ("192.0.0.0/24", "an IETF protocol assignment address"),
    ("192.0.2.0/24", "a documentation address"),
    ("192.31.196.0/24", "an AS112 service address"),
    ("192.52.193.0/24", "an AMT relay address"),
    ("192.88.99.0/24", "a 6to4 relay anycast address"),
    ("192.168.0.0/16", "a private address"),
    ("192.175.48.0/24", "an AS112 service address"),
    ("198.18.0.0/15", "a benchmarking address"),
    ("198.51.100.0/24", "a documentation address"),
    ("203.0.113.0/24", "a documentation address"),
    ("224.0.0.0/4", "a multicast address"),
    ("240.0.0.0/4", "a reserved address"),  # with the broadcast address, 255.255.255.255
)
_IPV6_SPECIAL: tuple[tuple[str, str], ...] = (
    # IANA's IPv6 Special-Purpose Address Registry, less the ranges that embed an IPv4
    # address (judged by it instead), plus site-local and multicast. The first match names it.
    ("::/128", "an unspecified address"),
    ("::1/128", "a loopback address"),
    ("64:ff9b:1::/48", "a local-use NAT64 address (its IPv4 form is the network's own)"),
    ("100::/64", "a discard-only address"),
    ("2001:2::/48", "a benchmarking address"),
    ("2001:3::/32", "an AMT relay address"),
    ("2001:4:112::/48", "an AS112 service address"),
    ("2001::/23", "an IETF protocol assignment address"),
    ("2001:db8::/32", "a documentation address"),
    ("2620:4f:8000::/48", "an AS112 service address"),
    ("3fff::/20", "a documentation address"),
    ("5f00::/16", "a segment routing (SRv6) address"),
    ("fd00:ec2::/32", "an address reserved for the provider's own services"),  # AWS's metadata
    ("fc00::/7", "a private (unique local) address"),
    ("fe80::/10", "a link-local address"),
    ("fec0::/10", "a site-local address"),
    ("ff00::/8", "a multicast address"),
)
# The ranges the server never connects to, with why; the first that holds an address names it.
_SPECIAL: tuple[tuple[Network, str], ...] = tuple(
    (ipaddress.ip_network(network), why) for network, why in _IPV4_SPECIAL + _IPV6_SPECIAL
)
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")  # the only IPv6 space IANA allocates as public
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052's well-known prefix
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # IPv4-translated, RFC 2765 and RFC 6145


class RefusedDestination(Exception):
    """The URL leads somewhere the server does not fetch from: the client's URL, a 400."""


class UnresolvableHost(Exception):
    """The host has no address (DNS failed): the fetching side, a 5xx."""


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolves ``host`` to, as numeric strings."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UnresolvableHost(f"the host {host!r} could not be resolved ({exc})") from exc
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True, slots=True)
class DestinationPolicy:
    """Public addresses, plus ``allowed_hosts`` (by name) and ``allowed_networks``."""

    allowed_hosts: frozenset[str] = frozenset()
    allowed_networks: tuple[Network, ...] = ()
    resolver: Resolver = system_resolver

    @classmethod
    def allowing(
        cls, entries: Iterable[str], resolver: Resolver = system_resolver
    ) -> DestinationPolicy:
        """A policy from ``--image-allow`` values: each an address, a network, or a host name."""
        hosts: set[str] = set()
        networks: list[Network] = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                hosts.add(_ascii_name(entry))
        return cls(frozenset(hosts), tuple(networks), resolver)

    def address_for(self, host: str, port: int) -> str:
        """The one checked address to connect to for ``host``, or ``RefusedDestination``.

        ``host`` is an address or a name in its ASCII form (IDNA A-labels), as
        it goes to DNS. Every address the name resolves to is checked: a name
        that mixes a public address with a private one is refused, not half
        trusted.
        """
        name = host.lower().rstrip(".")
        addresses = self.resolver(name, port)
        if not addresses:
            raise UnresolvableHost(f"the host {host!r} has no address")
        if name not in self.allowed_hosts:
            for text in addresses:
                reason = self.refusal(ipaddress.ip_address(text.split("%")[0]))
                if reason is not None:
                    raise RefusedDestination(f"{host} resolves to {text}, {reason}")
        return addresses[0]

    def refusal(self, address: Address) -> str | None:
        """Why the server does not connect to ``address``, or None when it may.

        An address in ``allowed_networks`` is allowed. One that embeds an IPv4
        address (IPv4-mapped, IPv4-translated, NAT64, 6to4, Teredo,
        IPv4-compatible) is judged by that IPv4 address, since that is where
        a translator or relay delivers it. Any other is refused when it is in
        a special-purpose range (``_SPECIAL``), outside IPv6's global unicast
        space, or not ``is_global`` to the running Python.
        """
        if any(address in network for network in self.allowed_networks):
            return None
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            reason = self.refusal(embedded)
            return None if reason is None else f"which embeds {embedded}, {reason}"
        for network, why in _SPECIAL:
            if address in network:
                return f"{why} ({network})"
        if address.version == 6 and address not in _GLOBAL_UNICAST:
            return f"an address outside IPv6's global unicast space ({_GLOBAL_UNICAST})"
        if not address.is_global:
            return f"{_kind(address)} address"
        return None


def _embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one embeds, or None when it embeds none.

    The forms are IPv4-mapped (``::ffff:0:0/96``), IPv4-translated
    (``::ffff:0:0:0/96``), NAT64's well-known prefix (``64:ff9b::/96``), 6to4
    (``2002::/16``), Teredo (``2001::/32``, the client's address) and
    IPv4-compatible (``::/96``, less ``::`` and ``::1``).
    """
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64 or address in _TRANSLATED:
        return ipaddress.IPv4Address(address.packed[12:])
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    packed = address.packed
    if packed[:12] == bytes(12) and packed[12:] not in (bytes(4), b"\0\0\0\1"):  # ::a.b.c.d
        return ipaddress.IPv4Address(packed[12:])
    return None


def _ascii_name(entry: str) -> str:
    """A host name from ``--image-allow`` in the ASCII form names are matched in.

    A non-ASCII name is encoded by Python's IDNA 2003 codec; for the few names
    IDNA 2008 encodes otherwise (with ß or ς), the operator writes the
    ``xn--`` form. A name neither encodes is kept as written and matches nothing.
    """
    name = entry.lower().rstrip(".")
    if name.isascii():
        return name
    try:
        return name.encode("idna").decode("ascii")
    except UnicodeError:
        return name


def _kind(address: Address) -> str:
    """The non-public range an address is in, with its article, for the refusal's message."""
    for kind in ("loopback", "unspecified", "link-local", "multicast", "private", "reserved"):
        if getattr(address, f"is_{kind.replace('-', '_')}"):
            return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    return "a non-public"
