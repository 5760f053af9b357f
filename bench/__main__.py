"""``python -m bench run default [--data DIR]``: damacy, zarr-python and tensorstore side by side.

Prints, per reader, median samples/s and output GB/s over the repeats and the ratio to
tensorstore, plus the decode bound; writes the figures as JSON too.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import runners
from bench.data import ensure
from bench.scenarios import SCENARIOS
from damacy_protocol.dtypes import numpy_dtype


def _cpu() -> float:
    """CPU seconds used by this process so far (every reader runs in this process)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def verify(scn, samples, readers) -> None:
    """Every reader returns the same batches (exactly) for the first batches of the run."""
    n = min(len(samples), 2 * scn.samples_per_batch)
    got = {}
    for name in readers:
        parts = []
        runners.READERS[name](scn, samples[:n], consume=lambda x, parts=parts: parts.append(x.copy()))
        got[name] = np.concatenate(parts)
    ref_name = readers[0]
    for name, value in got.items():
        if not np.array_equal(value, got[ref_name]):
            raise SystemExit(f"MISMATCH: {name} and {ref_name} disagree on the first {n} samples")
    print(f"verified: {', '.join(readers)} agree on the first {n} samples")


def _write(res: dict, path: str | None, prefix: str) -> int:
    out = Path(path) if path else Path("bench-results") / time.strftime(f"{prefix}%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    print(f"\nresults: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the scenarios")
    run = sub.add_parser("run", help="run scenarios")
    run.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS) + ["all"])
    run.add_argument("--data", default="bench-data", help="where datasets are written (reused when present)")
    run.add_argument("--repeats", type=int, default=5)
    run.add_argument("--batches", type=int, default=None, help="batches per repeat (default: the scenario's)")
    run.add_argument("--readers", default="damacy,tensorstore,zarr-python")
    run.add_argument("--json", default=None, help="where to write the results (default: bench-results/<time>.json)")
    def scenario_command(name: str, help: str, default: str, batches: int | None, repeats: int):
        cmd = sub.add_parser(name, help=help)
        cmd.add_argument("scenario", nargs="?", default=default, choices=sorted(SCENARIOS))
        cmd.add_argument("--data", default="bench-data")
        if batches is not None:
            cmd.add_argument("--batches", type=int, default=batches)
        cmd.add_argument("--repeats", type=int, default=repeats)
        cmd.add_argument("--json", default=None)
        return cmd

    dm = scenario_command("daemon", "damacyd with 1 and 2 client processes against the embedded engine", "default", 12, 3)
    dm.add_argument("--clients", default="1,2")
    rk = scenario_command("ranks", "K ranks re-reading their own samples for E epochs: damacyd vs per-rank readers, same cache memory", "node", None, 5)
    rk.add_argument("--ranks", type=int, default=2)
    rk.add_argument("--epochs", type=int, default=3)
    rk.add_argument("--cache", default="256M", help="cache memory on the node, for every reader")
    rk.add_argument("--data-size", default=None, help="decoded bytes the samples touch (default: twice --cache)")
    rk.add_argument("--readers", default="damacyd,embedded,tensorstore-cache,tensorstore")
    rm = scenario_command("remote", "the data over HTTP with Range and an injected latency: damacy vs tensorstore's http driver vs zarr-python with obstore", "default", 6, 5)
    rm.add_argument("--latency-ms", type=float, default=10.0, help="added to every request by the server")
    rm.add_argument("--readers", default="damacy,tensorstore,zarr-python")
    th = sub.add_parser("thin", help="planes and slabs of the default data: damacy's chunk-aware epochs vs a decode-once peer and tensorstore, same order, same memory")
    th.add_argument("kinds", nargs="*", default=["planes", "slabs"], help="planes, slabs")
    th.add_argument("--data", default="bench-data")
    th.add_argument("--memory", default="64M,256M", help="memory for decoded data, for every reader (a list: one run each)")
    th.add_argument("--repeats", type=int, default=3)
    th.add_argument("--readers", default="damacy,once,tensorstore,damacy-uniform")
    th.add_argument("--json", default=None)
    sc = sub.add_parser("scale", help="how costs grow: samples per epoch, arrays (NGFF plates), daemon sessions, decode threads; a table and a PNG")
    sc.add_argument("curves", nargs="*", default=["samples", "arrays", "sessions", "threads"], help="samples, arrays, sessions, threads")
    sc.add_argument("--data", default="bench-data")
    sc.add_argument("--samples", default="10000,100000,1000000,10000000,100000000", help="samples per epoch")
    sc.add_argument("--arrays", default="10,100,1000,10000,100000", help="images per plate")
    sc.add_argument("--sessions", default="1,2,4,8,16,32", help="client processes of one damacyd")
    sc.add_argument("--threads", default=None, help="decode threads (default: 1 to the cores)")
    sc.add_argument("--per-session", type=int, default=25, help="batches per session in the measured window")
    sc.add_argument("--batches", type=int, default=24, help="batches of the default scenario per thread count")
    sc.add_argument("--json", default=None)
    ry = sub.add_parser("ray", help="damacy.ray beside ray.data.read_zarr (Zarr v2, zarr-python 2) on a local Ray cluster")
    ry.add_argument("--data", default="bench-data")
    ry.add_argument("--repeats", type=int, default=3)
    ry.add_argument("--tasks", type=int, default=8, help="read tasks per dataset, for both readers")
    ry.add_argument("--json", default=None)
    gl = sub.add_parser("gil", help="the share of CPU under the interpreter lock (py-spy --gil) per workload, and the Amdahl ceiling it implies on 16, 64 and 128 cores")
    gl.add_argument("workloads", nargs="*", default=["boxes", "planes-cached", "daemon", "small-chunks"], help="boxes, small-chunks, planes-cached, daemon")
    gl.add_argument("--data", default="bench-data")
    gl.add_argument("--batches", type=int, default=24, help="batches of 8 in each measured phase (per client for daemon)")
    gl.add_argument("--repeats", type=int, default=3)
    gl.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    gl.add_argument("--stacks", default=None, help="a folder to keep py-spy's GIL-held stacks in (raw, one file per workload and repeat: flamegraph.pl reads them)")
    gl.add_argument("--json", default=None)
    scenario_command("transforms", "damacy with random flips and axis orders on every sample vs the same boxes plain", "default", 12, 5)
    args = ap.parse_args(argv)

    if args.cmd == "list":
        for s in SCENARIOS.values():
            print(f"{s.name:14} {s.description}")
        return 0

    if args.cmd == "ranks":
        from bench import ranks
        from damacy_server.daemon.cli import parse_size

        cache = parse_size(args.cache)
        size = parse_size(args.data_size) if args.data_size else 2 * cache
        readers = [r.strip() for r in args.readers.split(",") if r.strip()]
        unknown = sorted(set(readers) - set(ranks.READERS))
        if unknown:
            raise SystemExit(f"unknown readers {unknown}; choose from {', '.join(ranks.READERS)}")
        res = ranks.main(args.scenario, args.data, args.ranks, args.epochs, cache, size, args.repeats, readers)
        return _write(res, args.json, "ranks-")

    if args.cmd == "gil":
        from bench import gil

        unknown = sorted(set(args.workloads) - set(gil.WORKLOADS))
        if unknown:
            raise SystemExit(f"unknown workloads {unknown}; choose from {', '.join(gil.WORKLOADS)}")
        return _write(gil.main(args.workloads, args.data, args.batches, args.repeats, args.rate, args.stacks), args.json, "gil-")

    if args.cmd == "thin":
        from bench import thin
        from damacy_server.daemon.cli import parse_size

        readers = [r.strip() for r in args.readers.split(",") if r.strip()]
        unknown = sorted(set(readers) - set(thin.READERS)) + sorted(set(args.kinds) - set(thin.KINDS))
        if unknown:
            raise SystemExit(f"unknown {unknown}; readers: {', '.join(thin.READERS)}; kinds: {', '.join(thin.KINDS)}")
        memories = [parse_size(m) for m in args.memory.split(",") if m.strip()]
        return _write(thin.main(args.kinds, args.data, memories, args.repeats, readers), args.json, "thin-")

    if args.cmd == "scale":
        from bench import scale

        unknown = sorted(set(args.curves) - set(scale.CURVES))
        if unknown:
            raise SystemExit(f"unknown curves {unknown}; choose from {', '.join(scale.CURVES)}")
        ints = lambda text: [int(float(x)) for x in text.split(",") if x.strip()]  # noqa: E731
        threads = ints(args.threads) if args.threads else list(range(1, runners.CPUS + 1))
        res = scale.main(args.curves, args.data, ints(args.samples), ints(args.arrays), ints(args.sessions), threads, args.per_session, args.batches)
        code = _write(res, args.json, "scale-")
        out = Path(args.json) if args.json else sorted(Path("bench-results").glob("scale-*.json"))[-1]
        png = scale.plot(res, out.with_suffix(".png"))
        if png is not None:
            print(f"plot: {png}")
        return code

    if args.cmd == "ray":
        from bench import raydata

        return _write(raydata.main(args.data, args.repeats, args.tasks), args.json, "ray-")

    if args.cmd == "transforms":
        from bench import transforms

        res = transforms.main(args.scenario, args.data, args.batches, args.repeats)
        return _write(res, args.json, "transforms-")

    if args.cmd == "remote":
        from bench import remote

        readers = [r.strip() for r in args.readers.split(",") if r.strip()]
        res = remote.main(args.scenario, args.data, args.latency_ms, args.batches, args.repeats, readers)
        return _write(res, args.json, "remote-")

    if args.cmd == "daemon":
        from bench import daemon

        res = daemon.main(args.scenario, args.data, args.batches, args.repeats, [int(c) for c in args.clients.split(",")])
        return _write(res, args.json, "daemon-")

    names = sorted(n for n in SCENARIOS if n != "node") if "all" in args.scenarios else args.scenarios  # node: for ranks
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    results = {"machine": {"cpus": runners.CPUS, "python": sys.version.split()[0], "platform": platform.platform()}, "scenarios": {}}
    for name in names:
        scn = SCENARIOS[name]
        uris = ensure(scn.dataset, Path(args.data))
        n_batches = args.batches or scn.batches
        sample_bytes = int(np.prod(scn.sample_shape)) * numpy_dtype(scn.dtype).itemsize
        print(f"\n== {name}: {scn.description}; {n_batches} batches of {scn.samples_per_batch}, {args.repeats} repeats")
        verify(scn, scn.samples(uris, 2, seed=99), readers)
        times: dict[str, list[float]] = {r: [] for r in readers}
        steady: dict[str, list[float]] = {r: [] for r in readers}
        cpu: dict[str, list[float]] = {r: [] for r in readers + ["decode-bound"]}
        bound: list[float] = []
        first: list[float] = []
        extra = {}
        for rep in range(args.repeats):
            samples = scn.samples(uris, n_batches, seed=rep)
            for r in readers:
                c0 = _cpu()
                out = runners.READERS[r](scn, samples)
                cpu[r].append(_cpu() - c0)
                times[r].append(out["seconds"])
                # after the first batch: the rate a long training run sees (start-up excluded)
                rest = n_batches * scn.samples_per_batch - scn.samples_per_batch
                steady[r].append(rest / max(out["seconds"] - out["first_batch_s"], 1e-9))
                if r == "damacy":
                    first.append(out["first_batch_s"])
                    extra = out["stats"]
            b = runners.decode_bound(scn, samples)
            cpu["decode-bound"].append(b["cpu_seconds"])  # the decode threads only
            bound.append(b["seconds"])
        n = n_batches * scn.samples_per_batch
        rows = {}
        ts_rate = n / statistics.median(times["tensorstore"]) if "tensorstore" in times else None
        ts_steady = statistics.median(steady["tensorstore"]) if "tensorstore" in steady else None
        for r, ts_ in times.items():
            med = statistics.median(ts_)
            rate = n / med
            rows[r] = {
                "median_s": med,
                "samples_per_s": rate,
                "output_GBps": rate * sample_bytes / 1e9,
                "vs_tensorstore": rate / ts_rate if ts_rate else None,
                "runs_s": ts_,
                "cpu_ms_per_sample": 1e3 * statistics.median(cpu[r]) / n,
                "steady_samples_per_s": statistics.median(steady[r]),
                "steady_vs_tensorstore": statistics.median(steady[r]) / ts_steady if ts_steady else None,
            }
        bound_rate = n / statistics.median(bound)
        rows["decode-bound"] = {
            "median_s": statistics.median(bound),
            "samples_per_s": bound_rate,
            "output_GBps": bound_rate * sample_bytes / 1e9,
            "vs_tensorstore": bound_rate / ts_rate if ts_rate else None,
            "runs_s": bound,
            "cpu_ms_per_sample": 1e3 * statistics.median(cpu["decode-bound"]) / n,
        }
        ts_cpu = rows["tensorstore"]["cpu_ms_per_sample"] if "tensorstore" in rows else None
        print(
            f"{'reader':14} {'samples/s':>10} {'out GB/s':>9} {'x tensorstore':>14} {'median s':>9} {'cpu ms/sample':>14}"
            f" {'cpu x ts':>9} {'steady s/s':>11} {'steady x ts':>12}"
        )
        for r, row in rows.items():
            vs = f"{row['vs_tensorstore']:.2f}x" if row["vs_tensorstore"] else "-"
            cvs = f"{ts_cpu / row['cpu_ms_per_sample']:.2f}x" if ts_cpu else "-"
            st = f"{row['steady_samples_per_s']:11.1f}" if "steady_samples_per_s" in row else f"{'-':>11}"
            svs = f"{row['steady_vs_tensorstore']:.2f}x" if row.get("steady_vs_tensorstore") else "-"
            print(
                f"{r:14} {row['samples_per_s']:10.1f} {row['output_GBps']:9.3f} {vs:>14} {row['median_s']:9.3f}"
                f" {row['cpu_ms_per_sample']:14.2f} {cvs:>9} {st} {svs:>12}"
            )
        if "damacy" in rows:
            frac = rows["damacy"]["samples_per_s"] / bound_rate
            sfrac = rows["damacy"]["steady_samples_per_s"] / bound_rate
            print(
                f"damacy reaches {100 * frac:.0f}% of the decode bound ({100 * sfrac:.0f}% after the first batch);"
                f" first batch after {statistics.median(first):.3f}s (median)"
            )
            rows["damacy"]["fraction_of_decode_bound"] = frac
            rows["damacy"]["first_batch_s"] = statistics.median(first)
            rows["damacy"]["last_stats"] = extra
        results["scenarios"][name] = {"description": scn.description, "batches": n_batches, "samples": n, "repeats": args.repeats, "readers": rows}
    out = Path(args.json) if args.json else Path("bench-results") / time.strftime("%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
