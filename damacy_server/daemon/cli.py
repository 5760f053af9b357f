"""``damacyd``: start the per-node daemon.

Its limits are the value objects' (see :mod:`damacy_server.daemon.options`): a flag for each
field, named after it (``--array-entries`` sets ``MetadataCache.array_entries``), checked by
the value object's own check, whose refusal is a usage error naming the flag. A flag not
given takes the daemon's default (options.py), else the value object's.
"""

from __future__ import annotations

import os

# the daemon does no linear algebra: no BLAS thread pool (its threads spin after start). Set
# before numpy loads, which the limits' defaults below (the readers') bring in.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import grp  # noqa: E402
import logging  # noqa: E402
import pwd  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import click  # noqa: E402
import zmq  # noqa: E402

from damacy_protocol.errors import DamacyError  # noqa: E402
from damacy_runtime.cli_types import Seconds  # noqa: E402
from damacy_runtime.endpoint import default_endpoint  # noqa: E402

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``8G``, ``512MiB``, ``1073741824`` → bytes (binary units)."""
    match = _SIZE.match(str(text))
    if not match:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 8G, 512M, 1048576)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "")[:1].lower()])


def show_size(n: int) -> str:
    """Bytes as the largest binary unit that divides them: ``8G``, ``64K``, ``0``."""
    for unit in "TGMK":
        size = _UNITS[unit.lower()]
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


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



# -- the limits: one flag per field of the daemon's value objects ---------------------------
#: flag -> (type, help). Each sets the field options.FLAGS names; the default shown is the
#: daemon's (options.compose()).
_LIMIT_HELP: dict[str, tuple[Any, str]] = {
    "--memory": (Size(), "CpuLimits.max_memory_bytes: host memory for batch slots plus chunk data in flight, all sessions together."),
    "--decode-workers": (int, "CpuLimits.decode_workers: decode and assembly threads, sessions taking turns (default the CPUs plus one)."),
    "--max-encoded-chunk-bytes": (Size(), "CpuLimits.max_encoded_chunk_bytes: the largest stored chunk read; a larger one fails its sample (BudgetExceeded)."),
    "--max-decoded-chunk-bytes": (Size(), "CpuLimits.max_decoded_chunk_bytes: the largest decoded chunk (default: --max-chunk-bytes)."),
    "--chunks-per-input-buffer": (int, "CpuLimits.chunks_per_input_buffer: chunks per read buffer in flight (default 256, at least --decode-workers)."),
    "--chunk-cache": (Size(), "CpuLimits.chunk_cache_bytes: decoded chunks kept for all sessions (LRU by bytes); 0 turns it off."),
    "--no-native": (bool, "CpuLimits.native=False: decode and copy in numpy, not in damacy's C loop."),
    "--max-inflight-requests": (int, "CpuLimits.max_inflight_requests: object-store requests in flight at once."),
    "--chunk-cache-dir": (click.Path(file_okay=False), "CpuLimits.chunk_cache_dir: a folder on local disk (NVMe) for bytes fetched from object stores, read again from there by every session; off by default."),
    "--chunk-cache-dir-bytes": (Size(), "CpuLimits.chunk_cache_dir_bytes: the most the --chunk-cache-dir folder holds (least recently used entries go first)."),
    "--io-workers": (int, "FileReader.workers: reader threads, sessions taking turns (default the CPUs, at least 8)."),
    "--max-inflight-reads": (int, "FileReader.max_inflight_reads: reads queued at once."),
    "--no-readahead": (bool, "FileReader.readahead=False: chunk and shard files are read with POSIX_FADV_RANDOM (no kernel readahead)."),
    "--metadata-concurrency": (int, "FileMetadataReader.concurrency: zarr.json and shard-index reads in flight while a batch is planned."),
    "--array-entries": (int, "MetadataCache.array_entries: arrays' parsed metadata kept, all sessions."),
    "--shard-index-entries": (int, "MetadataCache.shard_index_entries: shard indexes kept, all sessions."),
    "--shard-index-bytes": (Size(), "MetadataCache.shard_index_bytes: the most bytes of shard indexes kept."),
    "--max-chunks": (int, "PlanLimits.max_chunks: chunk uses one batch may have (BudgetExceeded beyond)."),
    "--max-chunk-bytes": (Size(), "PlanLimits.max_chunk_bytes: the largest decoded chunk a batch may read (BudgetExceeded beyond); also the default of --max-decoded-chunk-bytes and --gpu-max-chunk-bytes."),
    "--max-shards-per-sample": (int, "PlanLimits.max_shards_per_sample: shards one sample may touch (InvalidArgument beyond)."),
    "--max-plan-bytes": (Size(), "PlanLimits.max_plan_bytes: the most bytes of one batch's plan (and of one query's index lists)."),
    "--max-gap-bytes": (Size(), "PlanLimits.max_gap_bytes: byte ranges of one file closer than this are read as one."),
    "--max-read-bytes": (Size(), "PlanLimits.max_read_bytes: the most bytes one coalesced read of a file has."),
    "--remote-max-gap-bytes": (Size(), "PlanLimits.remote_max_gap_bytes: as --max-gap-bytes, for object stores."),
    "--remote-max-read-bytes": (Size(), "PlanLimits.remote_max_read_bytes: as --max-read-bytes, for object stores."),
    "--gpu-memory": (Size(), "CudaLimits.max_gpu_memory_bytes, per GPU, for sessions with Config.device: device slots plus each batch's decode arena."),
    "--max-index-bytes": (Size(), "CudaLimits.max_index_bytes: per GPU batch, index storage of index queries (0: index queries refused on GPUs)."),
    "--chunk-layout-entries": (int, "CudaLimits.chunk_layout_entries: parsed Blosc headers kept per GPU."),
    "--gpu-max-chunk-bytes": (Size(), "CudaLimits.max_chunk_bytes: the largest decoded chunk on a GPU (default: --max-chunk-bytes)."),
    "--gpu-max-read-bytes": (Size(), "CudaLimits.max_read_bytes: the largest read of a GPU executor."),
    "--host-buffer-waves": (int, "CudaLimits.host_buffer_waves: batches read on the host ahead of the GPU (2 to 8)."),
    "--max-chunks-per-wave": (int, "CudaLimits.max_chunks_per_wave: chunks per GPU decode call."),
    "--max-substreams-per-chunk": (int, "CudaLimits.max_substreams_per_chunk: compressed streams per chunk on a GPU."),
}


def _param(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _limit_options(command):
    """Add the limit flags (in :data:`_LIMIT_HELP`'s order) to ``command``."""
    from damacy_server.daemon.options import FLAGS, compose

    where = {flag: key for key, flag in FLAGS.items()}
    assert set(where) == set(_LIMIT_HELP), "every daemon limit has its flag"
    defaults = compose()
    for flag, (tp, text) in reversed(_LIMIT_HELP.items()):
        part, name = where[flag]
        default = getattr(defaults[part], name)
        if tp is bool:
            command = click.option(flag, _param(flag), is_flag=True, default=False, help=text)(command)
            continue
        shown = show_size(default) if isinstance(tp, Size) else default
        if flag in ("--max-decoded-chunk-bytes", "--gpu-max-chunk-bytes", "--chunks-per-input-buffer", "--chunk-cache-dir"):
            shown = None  # follows another flag: the help says which
        if shown is not None:
            text = f"{text}  [default: {shown}]"
        command = click.option(flag, _param(flag), type=tp, default=None, help=text)(command)
    return command


def limits_given(params: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """The limit fields the flags in ``params`` (the command's parameters) set, by (part, field)."""
    from damacy_server.daemon.options import FLAGS

    given: dict[tuple[str, str], Any] = {}
    for key, flag in FLAGS.items():
        value = params.get(_param(flag))
        if _LIMIT_HELP[flag][0] is bool:  # a --no-... switch
            if value:
                given[key] = False
        elif value is not None:
            given[key] = value
    return given


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="damacy", prog_name="damacyd")
@click.option("--endpoint", default=None, help="ipc://PATH or tcp://HOST:PORT (default: $DAMACY_ENDPOINT, else the node's ipc:///tmp/damacy-UID/damacyd.sock).")
@click.option("--allow-root", "allow_roots", multiple=True, type=click.Path(exists=True, file_okay=False), help="A directory whose arrays may be served (repeatable). Without one, nothing is served.")
@click.option("--allow-prefix", "allow_prefixes", multiple=True, metavar="URI", help="An object-store prefix (s3://bucket/path, gs://, az://, https://host/path) whose arrays may be served (repeatable).")
@click.option("--storage-option", "storage_options", multiple=True, nargs=2, metavar="PREFIX KEY=VALUE", help="An option for the object stores under PREFIX (repeatable): obstore's store and client options (endpoint, region, timeout, allow_http, ...), max_retries, retry_timeout. Credentials come from the environment.")
@_limit_options
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
def main(**params: Any) -> None:
    """Serve Zarr batches to every training process on this node."""
    options = build_options(params)  # a value refused is a usage error, before anything starts
    endpoint, metrics = options.endpoint, params["metrics"]
    from damacy_server.daemon.logs import setup

    setup(params["log_level"], params["log_format"])
    from damacy_server.daemon.service import Daemon

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


def build_options(params: dict[str, Any]) -> Any:
    """The :class:`DaemonOptions` the command's parameters say (``params``: by parameter
    name, as click passes them); a value refused is a :class:`click.BadParameter` naming
    its flag. No daemon is started."""
    from damacy_server.daemon.options import DaemonOptions, LimitError, compose

    socket_mode = params["socket_mode"]
    try:
        mode = int(socket_mode, 8)
    except ValueError:
        raise click.BadParameter(f"{socket_mode!r} is not an octal mode", param_hint="--socket-mode") from None
    if not 0 <= mode <= 0o777:  # -1 became 07777 (anyone, setuid and sticky bits)
        raise click.BadParameter(f"{socket_mode!r} is not a mode from 000 to 777", param_hint="--socket-mode")
    try:
        limits = compose(limits_given(params))
    except LimitError as e:  # the value object's check, said with the flag(s) concerned
        raise click.BadParameter(str(e), param_hint=" / ".join(f"'{f}'" for f in e.flags) or None) from None
    max_message_size = params["max_message_size"]
    if max_message_size < 64 << 10:  # smaller, every request (a push of a batch's samples) is dropped
        raise click.BadParameter(f"{max_message_size} bytes: a request may need more; give at least 64K", param_hint="--max-message-size")
    secret = None
    if params["curve_secret_key"]:
        with open(params["curve_secret_key"], "rb") as f:
            secret = f.read().strip()
    per_prefix: dict[str, dict[str, str]] = {}
    for prefix, option in params["storage_options"]:
        name, eq, value = option.partition("=")
        if not eq or not name:
            raise click.BadParameter(f"{option!r} is not KEY=VALUE", param_hint="--storage-option")
        per_prefix.setdefault(prefix, {})[name] = value
    if per_prefix:  # each prefix's store made now (no request): a bad option is said at start, not at first use
        from damacy_server.store.remote import RemoteStores

        stores = RemoteStores(per_prefix)
        for prefix in per_prefix:
            try:
                stores.resolve(prefix)
            except DamacyError as e:
                raise click.BadParameter(str(e), param_hint="--storage-option") from None
    endpoint = params["endpoint"] or default_endpoint()
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        if port != "*" and not (port.isdigit() and int(port) < 1 << 16):
            raise click.BadParameter(f"{endpoint}: the port must be 0 to 65535 (0 or *: any free one)", param_hint="--endpoint")
    if params.get("metrics") is not None:
        from damacy_server.daemon.metrics import parse_address

        try:
            parse_address(params["metrics"])
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--metrics") from None
    return DaemonOptions(
        endpoint=endpoint,
        allow_roots=list(params["allow_roots"]),
        allow_prefixes=list(params["allow_prefixes"]),
        storage_options=per_prefix,
        **limits,
        socket_mode=mode,
        socket_group=params["socket_group"],
        curve_secret_key=secret,
        heartbeat_timeout_s=params["heartbeat_timeout"],
        slow_batch_s=params["slow_batch_s"],
        max_slots_per_session=params["max_slots_per_session"],
        max_lookahead_samples=params["max_lookahead_samples"],
        max_message_bytes=max_message_size,
        allow_uids=_ids(params["allow_uids"], lambda n: pwd.getpwnam(n).pw_uid, "uid"),
        allow_gids=_ids(params["allow_gids"], lambda n: grp.getgrnam(n).gr_gid, "gid"),
    )


if __name__ == "__main__":
    main()
