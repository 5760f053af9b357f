"""Where damacyd listens, and who may connect.

The default endpoint is the node's ``ipc:///tmp/damacy-UID/damacyd.sock`` (the same for every
process of the user; see :mod:`damacy_runtime.endpoint`), overridden by ``DAMACY_ENDPOINT``
or ``--endpoint``. The ipc socket file is
owner-only unless ``--socket-mode``/``--socket-group`` widen it (the slots' shared-memory
segments follow). A TCP endpoint binds only to loopback unless CURVE keys are given.

On an ipc socket the kernel tells who connects (``SO_PEERCRED``; ZeroMQ hands it over as
the message property ``Peer-Address``, ``uid:gid:pid``): the daemon logs it per session and
``--allow-uid``/``--allow-gid`` restrict sessions to those users and groups.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import zmq

from damacy_protocol.errors import InvalidArgument
from damacy_runtime.endpoint import check_private_folder, node_endpoint

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
_PEER = re.compile(r"(?:^|:)(\d+):(\d+):(\d+)$")


@dataclass(frozen=True)
class Peer:
    """A connecting process as the kernel reports it."""

    pid: int
    uid: int
    gids: tuple[int, ...]  # its group first, then the supplementary groups /proc shows

    def __str__(self) -> str:
        return f"peer pid {self.pid} uid {self.uid} gid {self.gids[0]}"


def peer_of(frame: Any, endpoint: str) -> Peer | None:
    """The credentials of the process that sent ``frame`` over an ipc socket, or None."""
    if frame is None or not endpoint.startswith("ipc://"):
        return None
    try:
        address = frame.get("Peer-Address")
    except Exception:  # noqa: BLE001 - a ZeroMQ without the property
        return None
    match = _PEER.search(address or "")
    if not match:
        return None
    uid, gid, pid = (int(v) for v in match.groups())
    return Peer(pid, uid, (gid, *_supplementary_groups(pid, uid, gid)))


def _supplementary_groups(pid: int, uid: int, gid: int) -> list[int]:
    """The process's other groups, when /proc shows the same process (same uid)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        if int(fields["Uid"].split()[1]) != uid:  # effective uid: another process took the pid
            return []
        return [g for g in (int(v) for v in fields.get("Groups", "").split()) if g != gid]
    except (OSError, KeyError, ValueError, IndexError):
        return []


def socket_gid(options: Any) -> int | None:
    """The group that owns the socket (and the slot segments), when one is set."""
    if not options.socket_group:
        return None
    try:
        return grp.getgrnam(options.socket_group).gr_gid
    except KeyError:
        raise InvalidArgument(f"--socket-group {options.socket_group!r}: no such group") from None


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
    if (getattr(options, "allow_uids", None) or getattr(options, "allow_gids", None)) and not endpoint.startswith("ipc://"):
        raise InvalidArgument("--allow-uid/--allow-gid need an ipc:// endpoint (TCP does not say who connects)")

    if options.curve_secret_key is not None:
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, options.curve_secret_key)
    path = ipc_path(endpoint)
    if path is None:
        socket.bind(endpoint)
        return
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if options.endpoint == node_endpoint():
        check_private_folder(folder)  # /tmp is shared: the folder must be this user's alone
    if os.path.exists(path):
        from damacy_runtime.probe import ping

        if ping(endpoint, timeout_s=0.5):
            raise InvalidArgument(f"another damacyd is serving {endpoint}")
        os.unlink(path)  # left by a daemon that died
    old = os.umask(0o077)  # the socket file is created owner-only, with no window
    try:
        socket.bind(endpoint)
    finally:
        os.umask(old)
    if options.socket_group:
        os.chown(path, -1, socket_gid(options))
    os.chmod(path, options.socket_mode)


def cleanup_endpoint(options: Any) -> None:
    path = ipc_path(options.endpoint)
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
