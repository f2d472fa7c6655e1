"""The one place rollfleet sockets are built, so their options are set consistently."""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any

import zmq
import zmq.asyncio

__all__ = ["SocketOptions", "make_socket", "ipc_path", "ipc_probe", "ipc_in_use", "split_host_port", "join_host_port"]

logger = logging.getLogger(__name__)


class SocketOptions:
    """Options applied to every socket; defaults suit local ipc:// and loopback tcp://."""

    __slots__ = ("hwm", "linger_ms", "max_message_bytes")

    def __init__(self, *, hwm: int = 0, linger_ms: int = 0, max_message_bytes: int = 1 << 30):
        # hwm 0 = no high-water mark: rollfleet bounds queues itself (in-flight caps), and a
        # ROUTER that hits its HWM drops messages silently, which would lose tokens.
        self.hwm = hwm
        self.linger_ms = linger_ms
        self.max_message_bytes = max_message_bytes


def make_socket(
    ctx: zmq.Context | zmq.asyncio.Context,
    kind: int,
    addr: str,
    *,
    bind: bool,
    identity: bytes | None = None,
    options: SocketOptions | None = None,
    curve_server_keys: tuple[bytes, bytes] | None = None,
    curve_client_keys: tuple[bytes, bytes, bytes] | None = None,
    zap_domain: str | None = None,
    monitor_events: int = 0,
) -> Any:
    """Create, configure and bind/connect a socket.

    ``curve_server_keys`` is (public, secret) for a binding socket that requires CurveZMQ;
    ``curve_client_keys`` is (public, secret, server_public) for a connecting one.
    ``zap_domain`` selects which key set the authenticator checks for this socket.
    ``monitor_events``: watch these connection events from before the bind/connect, so none is
    missed; ``sock.get_monitor_socket()`` then gives the PAIR socket they arrive on.
    Returns the socket; for ``tcp://host:0`` the bound port is in ``sock.LAST_ENDPOINT``.
    """
    opts = options or SocketOptions()
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, opts.linger_ms)
        sock.setsockopt(zmq.SNDHWM, opts.hwm)
        sock.setsockopt(zmq.RCVHWM, opts.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, opts.max_message_bytes)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if addr.startswith("tcp://["):  # an IPv6 address ([::1] say): ZeroMQ takes none without this
            sock.setsockopt(zmq.IPV6, 1)
        if kind == zmq.ROUTER:
            # Fail loudly (EHOSTUNREACH) instead of dropping a message to a peer that is gone.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if zap_domain is not None:
            sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain.encode())  # before bind, or it is ignored
        if curve_server_keys is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve_server_keys[0])
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve_server_keys[1])
        if curve_client_keys is not None:
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve_client_keys[0])
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve_client_keys[1])
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve_client_keys[2])
        if monitor_events:
            sock.get_monitor_socket(monitor_events)  # pyzmq keeps it: later calls return this one
        if bind:
            sock.bind(addr)
        else:
            sock.connect(addr)
    except Exception:
        sock.close(linger=0)
        raise
    return sock


def split_host_port(text: str, *, any_port: bool = False) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` (an IPv6 host in brackets, which are dropped) with a port in
    0..65535, or ``*`` (taken as 0, any free one) when ``any_port``; None when ``text`` is not that."""
    host, colon, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if any_port and port == "*":
        port = "0"
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        return None
    return host, int(port)


WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", ""})
"""Hosts of a bind address that listen on every interface: no address to dial."""


def bound_host(address: str) -> str:
    """The host of a ``tcp://HOST:PORT`` address (an IPv6 host without its brackets), '' for a
    wildcard one (WILDCARD_HOSTS) and for any other scheme."""
    if not address.startswith("tcp://"):
        return ""
    host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
    return "" if host in WILDCARD_HOSTS else host


def route_to(host: str) -> str | None:
    """This host's address on the route to ``host`` (a name, an IPv4 or an IPv6 address; no
    packet is sent), a loopback one included; None when ``host`` does not resolve here or no
    route leads to it. A name with both kinds of address is taken by its IPv4 ones first."""
    try:
        found = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    found.sort(key=lambda info: info[0] != socket.AF_INET)  # (stable: the resolver's order within each)
    for family, _, _, _, sockaddr in found:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
                return s.getsockname()[0]
            except OSError:
                continue
    return None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (an IPv4-mapped IPv6 one as its IPv4 address, a ``%scope``
    dropped); None for a name."""
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, a host starting ``127.``, and any loopback address (``::1``,
    ``::ffff:127.0.0.1``): no address of this host that other hosts can dial."""
    if host == "localhost" or host.startswith("127."):
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def route_source(host: str) -> str | None:
    """``route_to(host)`` when other hosts can dial it: None for a loopback one (the name stands
    for this host, or /etc/hosts maps it to 127.x) and for an IPv6 link-local one (it means
    nothing without this host's interface, which theirs do not share)."""
    source = route_to(host)
    ip = None if source is None else _ip(source)
    return None if ip is None or ip.is_loopback or ip.is_link_local else source


def join_host_port(host: str, port: int | str) -> str:
    """``HOST:PORT``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def ipc_path(addr: str) -> str | None:
    """The socket file of an ``ipc://`` address; None for other schemes and abstract names."""
    if not addr.startswith("ipc://") or addr.startswith("ipc://@"):
        return None
    return addr[len("ipc://"):]


def ipc_probe(addr: str) -> int | None:
    """Connect to the socket file of an ``ipc://`` address and hang up: 0 when a process serves
    it, else the connect's errno (ENOENT: no such file; ECONNREFUSED: a file nobody answers on,
    left by a process that died; EACCES: not this user's to reach, ...). None for another scheme
    or an abstract name."""
    path = ipc_path(addr)
    if path is None:
        return None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return 0
    except OSError as exc:
        return exc.errno
    finally:
        probe.close()


def ipc_in_use(addr: str) -> bool:
    """Whether a live process serves the socket file of an ``ipc://`` address. ZeroMQ binds over
    a file that exists, taking the address from whoever served it: check first. A file nobody
    answers on (left by a process that died) is not in use."""
    return ipc_probe(addr) == 0
