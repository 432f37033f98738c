"""Which addresses an image URL may lead the server to: public ones, and what the operator allows.

A client who can make the server fetch a URL can make it reach what only the
server can reach: its own loopback services, the private network behind it,
the cloud's metadata endpoint. So a destination is resolved once, every
address it resolves to must be public (``is_global``, and none of the ranges
below), and the fetch connects to the address that was checked; a second DNS
lookup would let an attacker's name answer differently the second time.
Operators open specific hosts or networks with ``--image-allow``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]  # host, port -> addresses as text

# Ranges ``is_global`` lets through that still reach the provider's own services.
_ALSO_REFUSED: tuple[Network, ...] = (
    ipaddress.ip_network("100.64.0.0/10"),  # CGNAT: Alibaba's metadata is 100.100.100.200
    ipaddress.ip_network("fd00:ec2::/32"),  # AWS's IPv6 metadata (also private, named for clarity)
)


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
                hosts.add(entry.lower().rstrip("."))
        return cls(frozenset(hosts), tuple(networks), resolver)

    def address_for(self, host: str, port: int) -> str:
        """The one checked address to connect to for ``host``, or ``RefusedDestination``.

        Every address the name resolves to is checked: a name that mixes a
        public address with a private one is refused, not half trusted.
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
        """Why the server does not connect to ``address``, or None when it may."""
        if any(address in network for network in self.allowed_networks):
            return None
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            reason = self.refusal(embedded)
            return None if reason is None else f"which embeds {embedded}, {reason}"
        if any(address in network for network in _ALSO_REFUSED):
            return "an address reserved for the provider's own services"
        if not address.is_global:
            return f"{_kind(address)} address"
        if address.is_multicast:
            return "a multicast address"
        return None


def _embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address inside an IPv4-mapped, -compatible, 6to4 or Teredo IPv6 one."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    packed = address.packed
    if packed[:12] == bytes(12) and packed[12:] not in (bytes(4), b"\0\0\0\1"):  # ::a.b.c.d
        return ipaddress.IPv4Address(packed[12:])
    return None


def _kind(address: Address) -> str:
    """The non-public range an address is in, with its article, for the refusal's message."""
    for kind in ("loopback", "unspecified", "link-local", "multicast", "private", "reserved"):
        if getattr(address, f"is_{kind.replace('-', '_')}"):
            return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    return "a non-public"
