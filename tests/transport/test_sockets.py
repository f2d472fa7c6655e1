"""Address helpers of transport.sockets."""

import ipaddress
import socket

import psutil
import pytest

from rollfleet.transport.sockets import is_loopback_host, join_host_port, route_source, route_to, split_host_port


def test_host_port_is_split_and_joined_with_ipv6_hosts_in_brackets():
    assert split_host_port("node-a:29500") == ("node-a", 29500)
    assert split_host_port("[::1]:0") == ("::1", 0)
    assert split_host_port(" 10.0.0.1:7 ") == ("10.0.0.1", 7)
    for text in ("node-a", ":5", "[]:5", "h:65536", "h:-1", "h:x", "h:*"):
        assert split_host_port(text) is None, text
    assert split_host_port("h:*", any_port=True) == ("h", 0)  # zmq's "any free port"
    assert join_host_port("::1", 5) == "[::1]:5" and join_host_port("node-a", "*") == "node-a:*"
    for host, port in (("::1", 5), ("node-a", 0)):
        assert split_host_port(join_host_port(host, port)) == (host, port)


def _own(family: int, link_local: bool = False) -> tuple[str, str] | None:
    """(an address of this machine of ``family``, its interface), not loopback; IPv6 link-local
    ones only with ``link_local``, global ones only without."""
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family != family:
                continue
            ip = ipaddress.ip_address(a.address.partition("%")[0])
            if not ip.is_loopback and ip.is_link_local == link_local:
                return ip.compressed, name
    return None


OWN_V4, OWN_V6, LINK_LOCAL = _own(socket.AF_INET), _own(socket.AF_INET6), _own(socket.AF_INET6, True)


def test_the_route_to_a_host_that_does_not_resolve_or_to_this_one_on_loopback_is_none():
    assert route_to("does-not-resolve.invalid") is None and route_source("does-not-resolve.invalid") is None
    assert route_to("127.0.0.1") == "127.0.0.1" and route_source("127.0.0.1") is None
    assert route_source("localhost") is None and route_source("::1") is None
    if route_to("::ffff:127.0.0.1") is not None:  # (an IPv6 stack that maps IPv4 addresses)
        assert route_source("::ffff:127.0.0.1") is None


@pytest.mark.skipif(OWN_V4 is None, reason="this machine has no IPv4 address but loopback")
def test_the_route_to_an_own_ipv4_address_starts_at_it():
    assert route_to(OWN_V4[0]) == OWN_V4[0] and route_source(OWN_V4[0]) == OWN_V4[0]


@pytest.mark.skipif(OWN_V6 is None, reason="this machine has no global IPv6 address")
def test_the_route_to_an_ipv6_host_is_an_ipv6_address():
    assert route_to(OWN_V6[0]) == OWN_V6[0] and route_source(OWN_V6[0]) == OWN_V6[0]


@pytest.mark.skipif(LINK_LOCAL is None, reason="this machine has no IPv6 link-local address")
def test_a_link_local_source_is_no_address_for_other_hosts():
    address, interface = LINK_LOCAL
    source = route_to(f"{address}%{interface}")
    assert source is not None and source.startswith("fe80:")  # the route exists ...
    assert route_source(f"{address}%{interface}") is None  # ... but names this host's interface


def test_loopback_hosts_are_told_apart_from_addresses_other_hosts_dial():
    for host in ("localhost", "127.0.0.1", "127.0.1.1", "::1", "0:0::1", "::ffff:127.0.0.1", "127.1"):
        assert is_loopback_host(host), host
    for host in ("10.0.0.1", "fd00::2", "::ffff:10.0.0.1", "node-a", "", "fe80::1%eth0"):
        assert not is_loopback_host(host), host
