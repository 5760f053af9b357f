"""``damacyd``: start the per-node daemon."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys

import click

from damacy_protocol.errors import DamacyError
from damacy_protocol.endpoint import default_endpoint

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``8G``, ``512MiB``, ``1073741824`` → bytes (binary units)."""
    match = _SIZE.match(str(text))
    if not match:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 8G, 512M, 1048576)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "")[:1].lower()])


class Size(click.ParamType):
    name = "bytes"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except click.BadParameter as e:
            self.fail(str(e), param, ctx)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--endpoint", default=None, help="ipc://PATH or tcp://HOST:PORT (default: $DAMACY_ENDPOINT, else an ipc socket under $XDG_RUNTIME_DIR or /tmp).")
@click.option("--allow-root", "allow_roots", multiple=True, type=click.Path(exists=True, file_okay=False), help="A directory whose arrays may be served (repeatable). Without one, nothing is served.")
@click.option("--memory", type=Size(), default="8G", show_default=True, help="Host memory for batch slots plus chunk data in flight, all sessions together.")
@click.option("--chunk-cache", type=Size(), default="0", show_default=True, help="Decoded chunks kept for all sessions (LRU by bytes); 0 turns it off.")
@click.option("--io-workers", type=click.IntRange(1), default=max(4, os.cpu_count() or 1), show_default=True)
@click.option("--decode-workers", type=click.IntRange(1), default=os.cpu_count() or 1, show_default=True)
@click.option("--socket-mode", default="600", show_default=True, help="Octal mode of the ipc socket file.")
@click.option("--socket-group", default=None, help="Group to own the ipc socket file (with --socket-mode 660 lets a group connect).")
@click.option("--curve-secret-key", type=click.Path(exists=True, dir_okay=False), default=None, help="File holding the daemon's CURVE secret key (z85); required for a TCP endpoint off loopback.")
@click.option("--heartbeat-timeout", type=float, default=5.0, show_default=True, help="Seconds of silence after which a client's session is reclaimed.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def main(endpoint, allow_roots, memory, chunk_cache, io_workers, decode_workers, socket_mode, socket_group, curve_secret_key, heartbeat_timeout, log_level):
    """Serve Zarr batches to every training process on this node."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s damacyd[%(process)d] %(levelname)s %(message)s")
    from damacy_server.service import Daemon, DaemonOptions

    try:
        mode = int(socket_mode, 8)
    except ValueError:
        raise click.BadParameter(f"{socket_mode!r} is not an octal mode", param_hint="--socket-mode") from None
    secret = None
    if curve_secret_key:
        with open(curve_secret_key, "rb") as f:
            secret = f.read().strip()
    options = DaemonOptions(
        endpoint=endpoint or default_endpoint(),
        allow_roots=list(allow_roots),
        memory_bytes=memory,
        chunk_cache_bytes=chunk_cache,
        io_workers=io_workers,
        decode_workers=decode_workers,
        socket_mode=mode,
        socket_group=socket_group,
        curve_secret_key=secret,
        heartbeat_timeout_s=heartbeat_timeout,
    )
    try:
        daemon = Daemon(options)
    except DamacyError as e:
        click.echo(f"damacyd: {e}", err=True)
        sys.exit(2)

    def stop(signum, frame):
        logging.getLogger("damacyd").info("signal %d: draining and stopping", signum)
        daemon.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # The loop thread answers requests between the engine's threads: let it take the GIL
    # within half a millisecond of a reply being due, not the default five.
    sys.setswitchinterval(0.0005)
    daemon.serve_forever()


if __name__ == "__main__":
    main()
