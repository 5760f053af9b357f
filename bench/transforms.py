"""What transforms at read time cost: the scenario's samples as they are, and the same
boxes each with a random flip of every axis (probability 1/2) and a random order of the
last two axes, read by damacy embedded in interleaved repeats (A, B, A, B, ...); medians of
samples/s and CPU ms per sample, and their ratios. The values are checked against numpy's
flip and transpose of the plain batch first."""

from __future__ import annotations

import resource
import statistics
from pathlib import Path

import numpy as np

import damacy
from bench import runners
from bench.data import ensure
from bench.scenarios import SCENARIOS


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def transformed(samples: list, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for s in samples:
        flip = tuple(int(a) for a in np.flatnonzero(rng.random(3) < 0.5))
        order = (0, 2, 1) if rng.random() < 0.5 else None
        out.append(damacy.Sample(s.uri, s.selection, flip=flip, transpose=order))
    return out


def main(scenario: str, data: str, batches: int, repeats: int) -> dict:
    scn = SCENARIOS[scenario]
    if scn.kind != "box" or scn.sample_shape[1] != scn.sample_shape[2]:
        raise SystemExit("transforms: a box scenario whose last two axes are as long is needed")
    uris = ensure(scn.dataset, Path(data))
    check = scn.samples(uris, 1, seed=99)
    plain, turned = [], []
    runners.run_damacy(scn, check, consume=lambda x: plain.append(x.copy()))
    moved = transformed(check, 99)
    runners.run_damacy(scn, moved, consume=lambda x: turned.append(x.copy()))
    for s, a, b in zip(moved, np.concatenate(plain), np.concatenate(turned)):
        want = np.transpose(np.flip(a, s.flip), s.transpose if s.transpose is not None else (0, 1, 2))
        if not np.array_equal(want, b):
            raise SystemExit(f"MISMATCH: {s} differs from numpy's flip/transpose of the plain read")
    print("verified: transformed samples equal numpy's np.transpose(np.flip(box)) of the plain ones")
    n = batches * scn.samples_per_batch
    rows = {"plain": {"s": [], "cpu": []}, "transformed": {"s": [], "cpu": []}}
    for rep in range(repeats):
        samples = scn.samples(uris, batches, seed=rep)
        runs = {"plain": samples, "transformed": transformed(samples, rep)}
        for name in (("plain", "transformed") if rep % 2 == 0 else ("transformed", "plain")):
            c0 = _cpu()
            out = runners.run_damacy(scn, runs[name])
            rows[name]["cpu"].append(_cpu() - c0)
            rows[name]["s"].append(out["seconds"])
            print(f"  repeat {rep}: {name:12} {n / out['seconds']:8.1f} samples/s, {1e3 * rows[name]['cpu'][-1] / n:6.2f} ms CPU/sample", flush=True)
    res = {}
    for name, r in rows.items():
        res[name] = {"samples_per_s": n / statistics.median(r["s"]), "cpu_ms_per_sample": 1e3 * statistics.median(r["cpu"]) / n, "runs_s": r["s"]}
    ratio_rate = res["transformed"]["samples_per_s"] / res["plain"]["samples_per_s"]
    ratio_cpu = res["transformed"]["cpu_ms_per_sample"] / res["plain"]["cpu_ms_per_sample"]
    for name, r in res.items():
        print(f"{name:12} {r['samples_per_s']:8.1f} samples/s {r['cpu_ms_per_sample']:7.2f} ms CPU/sample")
    print(f"transformed / plain: {ratio_rate:.3f}x samples/s, {ratio_cpu:.3f}x CPU per sample")
    return {"scenario": scenario, "batches": batches, "repeats": repeats, "readers": res, "rate_ratio": ratio_rate, "cpu_ratio": ratio_cpu}
