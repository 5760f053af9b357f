"""``damacy``: see damacy work (demo), and talk to the node's damacyd — ping it, warm its
caches, show its stats."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from damacy_protocol import messages as m
from damacy_protocol.errors import DamacyError
from damacy_protocol.stats import as_dict
from damacy_protocol.wire import absolute_uri, error_from_wire
from damacy_runtime.cli_types import Seconds

ENDPOINT = click.option("--endpoint", default=None, help="The daemon's endpoint (default: $DAMACY_ENDPOINT, else the default ipc socket).")


def _connect(endpoint):
    from damacy_client.transport import Connection

    try:
        conn = Connection(endpoint, connect_timeout_s=5.0)
        conn.call(lambda i: m.Attached(id=i), 5.0, "attach")
        return conn
    except DamacyError as e:  # none answers, or it refuses this user, or the endpoint is unsafe
        click.echo(f"damacy: {e}", err=True)
        sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="damacy", prog_name="damacy")
def main():
    """Stream a demo, or control and inspect damacyd, the per-node damacy daemon."""


@main.command()
@ENDPOINT
@click.option("--timeout", type=Seconds(0.0, 3600.0, min_open=True), default=2.0, show_default=True)
def ping(endpoint, timeout):
    """Check that damacyd answers."""
    from damacy_runtime.endpoint import default_endpoint
    from damacy_runtime.probe import ping as probe

    endpoint = endpoint or default_endpoint()
    hint = "start one with `damacyd --allow-root DIR`, or set DAMACY_ENDPOINT"
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
        click.echo(f"no damacyd at {endpoint}: the socket file does not exist ({hint})", err=True)
        sys.exit(1)
    t0 = time.perf_counter()
    key = os.environ.get("DAMACY_CURVE_SERVER_KEY")  # as the client uses it
    if not probe(endpoint, timeout, key.encode() if key else None):
        click.echo(f"no damacyd answers at {endpoint} ({hint})", err=True)
        sys.exit(1)
    click.echo(f"damacyd at {endpoint} answered in {(time.perf_counter() - t0) * 1e3:.1f} ms")


@main.command()
@ENDPOINT
@click.argument("uris", nargs=-1, required=True)
@click.option("--shard-indexes", is_flag=True, help="Also read every shard index.")
@click.option("--chunks", is_flag=True, help="Also decode every chunk into the daemon's chunk cache.")
def warm(endpoint, uris, shard_indexes, chunks):
    """Load arrays' metadata (and shard indexes, chunks) into the daemon's caches."""
    conn = _connect(endpoint)
    bar = None
    state = {"done": 0}

    def progress(msg):
        nonlocal bar
        state["total"] = msg.total
        if bar is None and msg.total:
            bar = click.progressbar(length=msg.total, label="warming", file=sys.stderr)
            bar.__enter__()
        if bar is not None:
            bar.update(msg.done - state["done"])
            state["done"] = msg.done

    cache = None
    try:
        # paths as this process names them: the daemon's working folder is its own
        wanted = [absolute_uri(u) for u in uris]
        call = conn.request(lambda i: m.Warm(id=i, uris=wanted, shard_indexes=shard_indexes, chunks=chunks), on_progress=progress)
        reply = call.wait(None, "warm")
        if chunks and not isinstance(reply, m.Failed):
            cache = conn.call(lambda i: m.Stats(id=i), 10.0, "stats").stats
    except DamacyError as e:  # the daemon stopped meanwhile
        click.echo(f"\ndamacy: {e}", err=True)
        sys.exit(1)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
        conn.close()
    if isinstance(reply, m.Failed):
        click.echo(f"damacy: {error_from_wire(reply.error)}", err=True)
        sys.exit(1)
    click.echo(f"warmed {reply.arrays} array(s), {reply.shard_indexes} shard index(es) newly read, {reply.chunks} chunk(s)")
    if cache is not None and cache.chunk_cache is not None and (cache.chunk_cache.entries < reply.chunks or reply.left):
        # (chunks never written are not counted: they read as the fill value, nothing to keep)
        click.echo(
            f"warning: the chunk cache holds {cache.chunk_cache.entries} chunk(s) now ({_fmt_bytes(cache.memory.chunk_cache_bytes)}); "
            f"{reply.chunks} of the arrays' {reply.chunks + reply.left} written chunks were cached, the rest did not fit "
            "(start damacyd with a larger --chunk-cache to keep them all)",
            err=True,
        )
    for e in reply.errors:
        click.echo(f"  error: {error_from_wire(e)}", err=True)
    if reply.errors:
        sys.exit(1)


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024


def render(stats, before=None, seconds: float | None = None) -> str:
    """The daemon's figures as text; with ``before`` (the figures ``seconds`` earlier) the
    rates since then too (``--watch``)."""
    d = stats["daemon"]
    rated = before is not None and seconds
    lines = [
        time.strftime("%Y-%m-%d %H:%M:%S")
        + f"  damacyd pid {d['pid']} at {d['endpoint']}, up {d['uptime_s']:.0f} s, serving {', '.join(d['allow_roots'] + d.get('allow_prefixes', [])) or 'no paths'}"
    ]
    if d.get("batches"):
        lines.append(
            f"loop: {1e3 * d.get('loop_cpu_s', 0.0) / d['batches']:.3f} ms of the loop's CPU per batch delivered, "
            f"{(d['messages'] + d.get('replies', 0)) / d['batches']:.1f} messages per batch ({d['batches']} batches)"
        )
    mem = stats["memory"]
    lines.append(
        f"memory: {_fmt_bytes(mem['in_use_bytes'])} in use of {_fmt_bytes(mem['budget_bytes'])} "
        f"(slots {_fmt_bytes(mem['slot_bytes'])}, peak {_fmt_bytes(mem['peak_bytes'])}), chunk cache {_fmt_bytes(mem['chunk_cache_bytes'])}"
    )
    lines.append(f"{'stage':10} {'count':>10} {'seconds':>10} {'in':>12} {'out':>12}" + (f" {'count/s':>10} {'out/s':>12} {'busy':>6}" if rated else ""))
    for name, s in stats["stages"].items():
        line = f"{name:10} {s['count']:10d} {s['seconds']:10.3f} {_fmt_bytes(s['bytes_in']):>12} {_fmt_bytes(s['bytes_out']):>12}"
        if rated:
            b = before["stages"].get(name, {"count": 0, "seconds": 0.0, "bytes_out": 0})
            busy = (s["seconds"] - b["seconds"]) / seconds  # threads busy in this stage, on average
            line += f" {(s['count'] - b['count']) / seconds:10.1f} {_fmt_bytes((s['bytes_out'] - b['bytes_out']) / seconds):>10}/s {busy:6.2f}"
        lines.append(line)
    caches = dict(stats["cache"])
    if stats.get("chunk_cache"):
        caches["chunks"] = stats["chunk_cache"]
    for name, c in caches.items():
        total = c["hits"] + c["misses"]
        rate = f"{100 * c['hits'] / total:.1f}%" if total else "-"
        rule = f", admitting by {c['admission']}" if c.get("admission", "lru") != "lru" else ""
        lines.append(f"cache {name}: {c['entries']} entries, hit rate {rate} ({c['hits']} hits, {c['misses']} misses){rule}")
    disk = stats.get("disk_cache")
    if disk:
        total = disk["hits"] + disk["misses"]
        rate = f"{100 * disk['hits'] / total:.1f}%" if total else "-"
        lines.append(
            f"cache disk: {disk['entries']} entries ({_fmt_bytes(disk['bytes'])}), hit rate {rate} ({disk['hits']} hits, "
            f"{disk['misses']} misses), {disk['writes']} written, {disk['evictions']} evicted, {disk['refused']} refused"
        )
    sessions = [s for s in stats["sessions"] if not s.get("control")]
    lines.append(f"sessions: {len(sessions)}")
    earlier = {s["session"]: s for s in (before or {}).get("sessions", [])}
    for s in sessions:
        rate = ""
        if rated and s["session"] in earlier:
            rate = f", {(s['samples'] - earlier[s['session']]['samples']) / seconds:.1f} samples/s"
        lines.append(
            f"  {s['session']} pid {s['pid']} rank {s['rank']}: {s['batches']} batches, {s['samples']} samples{rate}, "
            f"{s['held_batches']} held, {s.get('queued_samples', 0)} queued, {s.get('slot_waits', 0)} slot waits, "
            f"{s['samples_per_batch']} x {tuple(s['sample_shape'])} {s['dtype']}"
        )
    return "\n".join(lines)


@main.command()
@ENDPOINT
@click.option("--json", "as_json", is_flag=True, help="Print the raw figures as JSON.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until interrupted.")
@click.option("--interval", type=Seconds(0.1, 86400.0), default=2.0, show_default=True)
def stats(endpoint, as_json, watch, interval):
    """Per-stage timings, cache hit rates, sessions and memory of the daemon."""
    conn = _connect(endpoint)
    before, then = None, None
    try:
        while True:
            try:
                data = as_dict(conn.call(lambda i: m.Stats(id=i), 10.0, "stats").stats)
            except DamacyError as e:
                click.echo(f"damacy: {e}", err=True)
                sys.exit(1)
            now = time.monotonic()
            if watch and not as_json:
                click.clear()
            click.echo(json.dumps(data, indent=2) if as_json else render(data, before, None if then is None else now - then))
            before, then = data, now
            if not watch:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()


@main.command()
@click.argument("uri", required=False)
@click.option("--endpoint", default=None, help="Stream through the damacyd at this endpoint (default: embedded, in this process).")
@click.option("--batches", type=click.IntRange(1), default=100, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=8, show_default=True)
@click.option("--size", type=click.Choice(["default", "small"]), default="default", show_default=True, help="The generated volume (without a uri): 256x512x512 or 64x128x128 uint16.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Where the generated volume is kept (default: ~/.cache/damacy).")
def demo(uri, endpoint, batches, batch_size, size, data_dir):
    """Stream random boxes into float32 batches and show the rate.

    Without URI, a sharded, zstd-compressed volume is written once (into --data-dir) and
    streamed; with URI, that Zarr array (v3 or v2, or an NGFF image) is."""
    from damacy import demo as d

    try:
        if uri is None:
            uri = str(d.demo_volume(size, data_dir, log=lambda s: click.echo(s, err=True)))
        d.run(uri, batches, batch_size, endpoint)
    except OSError as e:  # the data folder cannot be made or written
        click.echo(f"damacy: cannot write the demo volume: {e}", err=True)
        sys.exit(1)
    except DamacyError as e:
        click.echo(f"damacy: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
