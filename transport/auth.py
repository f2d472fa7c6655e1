"""CurveZMQ keys and the rule for non-loopback addresses.

A fleet that binds anything but loopback must encrypt and authenticate: ``rollfleet keys
DIR`` writes a server key pair, a client key pair and ``DIR/authorized/`` (public keys
allowed to connect). The supervisor loads the server secret and the authorized keys; each
worker it spawns gets an ephemeral key pair that is authorized for that fleet only.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import tempfile
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = [
    "is_loopback_address",
    "check_bind",
    "make_keys",
    "load_server_keys",
    "load_client_keys",
    "Authenticator",
    "CLIENT_DOMAIN",
    "WORKER_DOMAIN",
]

logger = logging.getLogger(__name__)


def is_loopback_address(addr: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback host."""
    scheme, _, rest = addr.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or '*': may be reachable from elsewhere


def check_bind(addr: str, keys_dir: str | None) -> None:
    if not is_loopback_address(addr) and keys_dir is None:
        raise ValueError(
            f"refusing to bind {addr}: it is not a loopback address, so it needs CurveZMQ keys. "
            "Create them with `rollfleet keys DIR` and pass curve_keys_dir=DIR (or --keys-dir DIR); "
            "clients then connect with DIR/client.key_secret and DIR/server.key."
        )


def make_keys(directory: str, *, overwrite: bool = False) -> dict[str, str]:
    """Write server and client key pairs and the authorized/ directory; returns the paths.

    Keys already in ``directory`` are kept: FileExistsError, unless ``overwrite`` (keys handed
    out before then stop working). Secret keys are readable by their owner only from the
    moment they exist (written in a private directory, then moved into place)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CurveZMQ support")
    names = ("server.key", "server.key_secret", "client.key", "client.key_secret")
    existing = [n for n in names if os.path.exists(os.path.join(directory, n))]
    if existing and not overwrite:
        raise FileExistsError(f"{directory} already holds keys ({', '.join(existing)}); replacing them "
                              "locks out every client given the old ones")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    scratch = tempfile.mkdtemp(prefix=".keys-", dir=directory)  # 0700
    try:
        zmq.auth.create_certificates(scratch, "server")
        zmq.auth.create_certificates(scratch, "client")
        for name in names:
            os.chmod(os.path.join(scratch, name), 0o600 if name.endswith("_secret") else 0o644)
            os.replace(os.path.join(scratch, name), os.path.join(directory, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    authorized = os.path.join(directory, "authorized")
    os.makedirs(authorized, mode=0o700, exist_ok=True)
    os.chmod(authorized, 0o700)
    shutil.copy(os.path.join(directory, "client.key"), os.path.join(authorized, "client.key"))
    path = os.path.join
    return {"server_public": path(directory, "server.key"), "server_secret": path(directory, "server.key_secret"),
            "client_public": path(directory, "client.key"), "client_secret": path(directory, "client.key_secret"),
            "authorized": authorized}


def _load(directory: str, name: str) -> tuple[bytes, bytes | None]:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        where = "is not a directory" if not os.path.isdir(directory) else f"holds no {name}"
        raise FileNotFoundError(f"keys directory {directory} {where}: `rollfleet keys DIR` makes one")
    return zmq.auth.load_certificate(path)


def load_server_keys(directory: str) -> tuple[bytes, bytes]:
    public, secret = _load(directory, "server.key_secret")
    if secret is None:
        raise ValueError(f"{directory}/server.key_secret holds no secret key")
    return public, secret


def load_client_keys(directory: str) -> tuple[bytes, bytes, bytes]:
    """(client public, client secret, server public), as RemoteClient's curve_keys wants."""
    public, secret = _load(directory, "client.key_secret")
    server_public, _ = _load(directory, "server.key")
    if secret is None:
        raise ValueError(f"{directory}/client.key_secret holds no secret key")
    return public, secret, server_public


CLIENT_DOMAIN = "rollfleet-clients"
WORKER_DOMAIN = "rollfleet-workers"


class _KeySet:
    def __init__(self, name: str) -> None:
        self.name = name
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        # pyzmq hands over the Z85 form (as certificates hold it); accept raw 32 bytes too.
        if len(key) == 32:
            key = zmq.utils.z85.encode(key)
        ok = key in self.keys
        if not ok:
            logger.warning("refused a %s connection with an unknown CurveZMQ key", self.name)
        return ok


class Authenticator:
    """ZAP handler with two key sets, one per socket (ZAP domain): clients may only reach the
    client socket, workers only the worker socket. A client key can never register a worker."""

    def __init__(self, ctx: zmq.Context, keys_dir: str):
        self.clients = _KeySet("client")
        self.workers = _KeySet("worker")
        authorized = os.path.join(keys_dir, "authorized")
        if os.path.isdir(authorized):
            self.clients.keys.update(zmq.auth.load_certificates(authorized).keys())
        self._thread = ThreadAuthenticator(ctx, log=logger)
        self._thread.start()
        self._thread.configure_curve_callback(domain=CLIENT_DOMAIN, credentials_provider=self.clients)
        self._thread.configure_curve_callback(domain=WORKER_DOMAIN, credentials_provider=self.workers)

    def allow(self, public_key: bytes) -> None:
        """Admit a worker key (Z85) on the worker socket."""
        self.workers.keys.add(public_key)

    def allow_client(self, public_key: bytes) -> None:
        self.clients.keys.add(public_key)

    def stop(self) -> None:
        self._thread.stop()


def as_str_keys(keys: Any) -> list[str]:
    return [k.decode() if isinstance(k, bytes) else str(k) for k in keys]
