"""``damacyd``: start the per-node daemon."""

from __future__ import annotations

import grp
import logging
import os
import pwd
import re
import signal
import sys

import click
import zmq

from damacy_protocol.checks import default_decode_workers
from damacy_protocol.errors import DamacyError
from damacy_runtime.cli_types import Seconds
from damacy_runtime.endpoint import default_endpoint

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
            out = parse_size(value)
        except click.BadParameter as e:
            self.fail(str(e), param, ctx)
        if out >= 1 << 63:
            self.fail(f"{value!r} is more bytes than any machine holds (at most 2**63 - 1)", param, ctx)
        return out


def _ids(values, lookup, what: str) -> list[int]:
    """User or group names or numbers → numeric ids."""
    out = []
    for v in values:
        if str(v).isdigit():
            out.append(int(v))
            continue
        try:
            out.append(lookup(v))
        except KeyError:
            raise click.BadParameter(f"no {what} named {v!r}", param_hint=f"--allow-{what[0]}id") from None
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="damacy", prog_name="damacyd")
@click.option("--endpoint", default=None, help="ipc://PATH or tcp://HOST:PORT (default: $DAMACY_ENDPOINT, else the node's ipc:///tmp/damacy-UID/damacyd.sock).")
@click.option("--allow-root", "allow_roots", multiple=True, type=click.Path(exists=True, file_okay=False), help="A directory whose arrays may be served (repeatable). Without one, nothing is served.")
@click.option("--allow-prefix", "allow_prefixes", multiple=True, metavar="URI", help="An object-store prefix (s3://bucket/path, gs://, az://, https://host/path) whose arrays may be served (repeatable).")
@click.option("--storage-option", "storage_options", multiple=True, nargs=2, metavar="PREFIX KEY=VALUE", help="An option for the object stores under PREFIX (repeatable): obstore's store and client options (endpoint, region, timeout, allow_http, ...), max_retries, retry_timeout. Credentials come from the environment.")
@click.option("--memory", type=Size(), default="8G", show_default=True, help="Host memory for batch slots plus chunk data in flight, all sessions together.")
@click.option("--gpu-memory", type=Size(), default="4G", show_default=True, help="Per GPU, for sessions with Config.device: device slots plus each batch's decode arena.")
@click.option("--chunk-cache", type=Size(), default="0", show_default=True, help="Decoded chunks kept for all sessions (LRU by bytes); 0 turns it off.")
@click.option("--chunk-cache-dir", type=click.Path(file_okay=False), default=None, help="A folder on local disk (NVMe) for bytes fetched from object stores, read again from there by every session; off by default.")
@click.option("--chunk-cache-dir-bytes", type=Size(), default="64G", show_default=True, help="The most the --chunk-cache-dir folder holds (least recently used entries go first).")
@click.option("--io-workers", type=click.IntRange(1), default=max(4, os.cpu_count() or 1), show_default=True)
@click.option("--decode-workers", type=click.IntRange(1), default=default_decode_workers(), show_default=True, help="Decoder threads (default: the CPUs plus one).")
@click.option("--socket-mode", default="600", show_default=True, help="Octal mode of the ipc socket file.")
@click.option("--socket-group", default=None, help="Group to own the ipc socket file and the slots' shared memory (with --socket-mode 660 lets a group connect).")
@click.option("--allow-uid", "allow_uids", multiple=True, help="Accept sessions only from this user (name or uid; repeatable; with --allow-gid, either suffices). The daemon's own user is always accepted. ipc endpoints only.")
@click.option("--allow-gid", "allow_gids", multiple=True, help="Accept sessions only from members of this group (name or gid; repeatable).")
@click.option("--max-slots-per-session", type=click.IntRange(1), default=64, show_default=True, help="Most batch slots (Config.prepared_batches) one session may have; each is a shared-memory mapping and a file descriptor.")
@click.option("--max-lookahead-samples", type=click.IntRange(1), default=65536, show_default=True, help="Most samples one session may have pushed ahead of its batches (Config.lookahead_samples is held to it): queued samples are the daemon's memory, outside --memory.")
@click.option("--max-message-size", type=Size(), default="64M", show_default=True, help="Largest request accepted; a larger one drops its connection.")
@click.option("--curve-secret-key", type=click.Path(exists=True, dir_okay=False), default=None, help="File holding the daemon's CURVE secret key (z85); required for a TCP endpoint off loopback.")
@click.option("--heartbeat-timeout", type=Seconds(2.0, 86400.0), default=5.0, show_default=True, help="Seconds of silence after which a client's session is reclaimed (at least 2: clients send a heartbeat every second).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True, help="json: one object a line (time, level, event, session, pid, rank, uri, error).")
@click.option("--slow-batch-s", type=Seconds(0), default=10.0, show_default=True, help="Log a batch that takes longer than this from its start to ready (event slow_batch); 0: never.")
@click.option("--metrics", "metrics", default=None, metavar="[HOST:]PORT", help="Serve Prometheus metrics at http://HOST:PORT/metrics (HOST defaults to 127.0.0.1; off by default).")
def main(endpoint, allow_roots, allow_prefixes, storage_options, memory, gpu_memory, chunk_cache, chunk_cache_dir, chunk_cache_dir_bytes, io_workers, decode_workers, socket_mode, socket_group, allow_uids, allow_gids, max_slots_per_session, max_lookahead_samples, max_message_size, curve_secret_key, heartbeat_timeout, log_level, log_format, slow_batch_s, metrics):
    """Serve Zarr batches to every training process on this node."""
    from damacy_server.daemon.logs import setup

    setup(log_level, log_format)
    # the daemon does no linear algebra: no BLAS thread pool (its threads spin after start)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from damacy_server.daemon.options import DaemonOptions
    from damacy_server.daemon.service import Daemon

    try:
        mode = int(socket_mode, 8)
    except ValueError:
        raise click.BadParameter(f"{socket_mode!r} is not an octal mode", param_hint="--socket-mode") from None
    if not 0 <= mode <= 0o777:  # -1 became 07777 (anyone, setuid and sticky bits)
        raise click.BadParameter(f"{socket_mode!r} is not a mode from 000 to 777", param_hint="--socket-mode")
    for flag, value in (("--memory", memory), ("--chunk-cache-dir-bytes", chunk_cache_dir_bytes)):
        if value < 1:  # (said by the flag, not by the Config field it becomes)
            raise click.BadParameter(f"{value} bytes: give at least 1", param_hint=flag)
    if max_message_size < 64 << 10:  # smaller, every request (a push of a batch's samples) is dropped
        raise click.BadParameter(f"{max_message_size} bytes: a request may need more; give at least 64K", param_hint="--max-message-size")
    secret = None
    if curve_secret_key:
        with open(curve_secret_key, "rb") as f:
            secret = f.read().strip()
    per_prefix: dict[str, dict[str, str]] = {}
    for prefix, option in storage_options:
        name, eq, value = option.partition("=")
        if not eq or not name:
            raise click.BadParameter(f"{option!r} is not KEY=VALUE", param_hint="--storage-option")
        per_prefix.setdefault(prefix, {})[name] = value
    if per_prefix:  # each prefix's store made now (no request): a bad option is said at start, not at first use
        from damacy_protocol.errors import DamacyError
        from damacy_server.store.remote import RemoteStores

        stores = RemoteStores(per_prefix)
        for prefix in per_prefix:
            try:
                stores.resolve(prefix)
            except DamacyError as e:
                raise click.BadParameter(str(e), param_hint="--storage-option") from None
    endpoint = endpoint or default_endpoint()
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        if port != "*" and not (port.isdigit() and int(port) < 1 << 16):
            raise click.BadParameter(f"{endpoint}: the port must be 0 to 65535 (0 or *: any free one)", param_hint="--endpoint")
    options = DaemonOptions(
        endpoint=endpoint,
        allow_roots=list(allow_roots),
        allow_prefixes=list(allow_prefixes),
        storage_options=per_prefix,
        memory_bytes=memory,
        gpu_memory_bytes=gpu_memory,
        chunk_cache_bytes=chunk_cache,
        chunk_cache_dir=chunk_cache_dir,
        chunk_cache_dir_bytes=chunk_cache_dir_bytes,
        io_workers=io_workers,
        decode_workers=decode_workers,
        socket_mode=mode,
        socket_group=socket_group,
        curve_secret_key=secret,
        heartbeat_timeout_s=heartbeat_timeout,
        slow_batch_s=slow_batch_s,
        max_slots_per_session=max_slots_per_session,
        max_lookahead_samples=max_lookahead_samples,
        max_message_bytes=max_message_size,
        allow_uids=_ids(allow_uids, lambda n: pwd.getpwnam(n).pw_uid, "uid"),
        allow_gids=_ids(allow_gids, lambda n: grp.getgrnam(n).gr_gid, "gid"),
    )
    if metrics is not None:
        from damacy_server.daemon.metrics import parse_address

        try:
            parse_address(metrics)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--metrics") from None
    try:
        daemon = Daemon(options)
    except DamacyError as e:
        click.echo(f"damacyd: {e}", err=True)
        sys.exit(2)
    except (zmq.ZMQError, OSError) as e:  # the endpoint (a port in use, a path too long), a folder, a key
        click.echo(f"damacyd: cannot start on {endpoint} (or with the folders and key it was given): {e}", err=True)
        sys.exit(2)
    if metrics is not None:
        from damacy_server.daemon.metrics import serve

        try:
            daemon.metrics_server, _ = serve(daemon, metrics)
        except OSError as e:
            click.echo(f"damacyd: --metrics {metrics}: {e.strerror or e}", err=True)
            daemon.shutdown()
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
