"""Where damacyd listens, and who may connect.

The default endpoint is an ``ipc://`` socket under the user's runtime directory
(``$XDG_RUNTIME_DIR``, else /tmp), overridden by ``DAMACY_ENDPOINT``. The ipc socket file is
owner-only unless ``--socket-mode``/``--socket-group`` widen it. A TCP endpoint binds only to
loopback unless CURVE keys are given.
"""

from __future__ import annotations

import grp
import ipaddress
import os
from typing import Any
from urllib.parse import urlparse

import zmq

from damacy_protocol.errors import InvalidArgument

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str, curve: bool) -> None:
    if endpoint.startswith("ipc://"):
        if not ipc_path(endpoint):
            raise InvalidArgument(f"endpoint {endpoint!r} has no path")
        return
    if endpoint.startswith("tcp://"):
        host = urlparse(endpoint).hostname or ""
        if not _is_loopback(host) and not curve:
            raise InvalidArgument(
                f"endpoint {endpoint!r} is reachable from other machines; damacyd binds TCP only to loopback "
                "(127.0.0.1) unless CURVE keys are given (--curve-secret-key)"
            )
        return
    raise InvalidArgument(f"endpoint {endpoint!r}: use ipc://PATH or tcp://HOST:PORT")


def bind_socket(socket: zmq.Socket, options: Any) -> None:
    """Bind the daemon's ROUTER socket per ``options`` (endpoint, socket mode/group, CURVE)."""
    endpoint = options.endpoint
    check_endpoint(endpoint, options.curve_secret_key is not None)
    if options.curve_secret_key is not None:
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, options.curve_secret_key)
    path = ipc_path(endpoint)
    if path is None:
        socket.bind(endpoint)
        return
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        from damacy_client.probe import ping

        if ping(endpoint, timeout_s=0.5):
            raise InvalidArgument(f"another damacyd is serving {endpoint}")
        os.unlink(path)  # left by a daemon that died
    old = os.umask(0o077)  # the socket file is created owner-only, with no window
    try:
        socket.bind(endpoint)
    finally:
        os.umask(old)
    if options.socket_group:
        os.chown(path, -1, grp.getgrnam(options.socket_group).gr_gid)
    os.chmod(path, options.socket_mode)


def cleanup_endpoint(options: Any) -> None:
    path = ipc_path(options.endpoint)
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
