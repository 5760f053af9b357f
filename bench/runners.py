"""One function per reader: each reads the same samples into f32 batches and returns timings.

Timed runs do nothing with a batch but let go of it (the training step is taken as free);
agreement between the readers is checked on separate runs (``verify``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np

import damacy
from damacy_protocol.dtypes import numpy_dtype
from damacy_protocol.limits import host_threads

CPUS = os.cpu_count() or 1


def proc_stat(pid: int) -> tuple[int, float]:
    """A process's parent and the CPU seconds it has used so far (Linux' /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """CPU seconds a process has used so far."""
    return proc_stat(pid)[1]


def batches_of(samples: list, n: int) -> list[list]:
    return [samples[i : i + n] for i in range(0, len(samples), n)]


# -- damacy ---------------------------------------------------------------------------


def damacy_config(scn, **kw) -> damacy.Config:
    """damacy's Config for a scenario, its threads sized to this host as the seed API's
    guides ask (its defaults, 8 decode and 64 I/O threads, are a big node's: on 2 cores they
    cost about 8% of the samples/s and 10% more CPU per sample in the default scenario)."""
    decode, io = host_threads()
    kw.setdefault("decode_workers", decode)
    kw.setdefault("n_io_threads", io)
    return damacy.Config(
        samples_per_batch=scn.samples_per_batch,
        sample_shape=scn.sample_shape,
        dtype=scn.dtype,
        max_memory_bytes=kw.pop("max_memory_bytes", 4 << 30),
        lookahead_samples=kw.pop("lookahead_samples", 3 * scn.samples_per_batch),
        prepared_batches=kw.pop("prepared_batches", 3),
        pop_timeout_s=600,
        drop_last=kw.pop("drop_last", False),  # every sample, as the other readers read them
        **kw,
    )


def run_damacy(scn, samples: list, consume: Callable[[np.ndarray], None] | None = None) -> dict:
    t0 = time.perf_counter()
    with damacy.Pipeline(damacy_config(scn)) as pipe:
        pipe.push(samples)
        first = None
        for batch in pipe.batches():
            with batch:
                if first is None:
                    first = time.perf_counter() - t0
                if consume is not None:
                    consume(batch.numpy())
        seconds = time.perf_counter() - t0
        stats = pipe.stats_dict()
    return {"seconds": seconds, "first_batch_s": first, "stats": stats}


# -- zarr-python ------------------------------------------------------------------------


def _selection(sample):
    if isinstance(sample, damacy.Sample):
        return tuple(slice(a, b) for a, b in sample.aabb)
    return tuple(s if isinstance(s, slice) else list(s) for s in sample.selection)


def run_zarr(scn, samples: list, consume: Callable[[np.ndarray], None] | None = None) -> dict:
    import zarr

    t0 = time.perf_counter()
    first = None
    arrays = {}
    out = np.empty((scn.samples_per_batch, *scn.sample_shape), dtype=numpy_dtype(scn.dtype))
    for batch in batches_of(samples, scn.samples_per_batch):
        for i, s in enumerate(batch):
            arr = arrays.get(s.uri)
            if arr is None:
                if s.uri.startswith(("http://", "https://")):  # through obstore, as zarr-python reads object stores
                    from obstore.store import HTTPStore

                    store = zarr.storage.ObjectStore(HTTPStore.from_url(s.uri, client_options={"allow_http": True}), read_only=True)
                    arr = arrays[s.uri] = zarr.open_array(store=store, mode="r")
                else:
                    arr = arrays[s.uri] = zarr.open_array(s.uri, mode="r")
            sel = _selection(s)
            out[i] = arr[sel] if isinstance(s, damacy.Sample) else arr.oindex[sel]
        first = first or time.perf_counter() - t0
        if consume is not None:
            consume(out[: len(batch)])
    return {"seconds": time.perf_counter() - t0, "first_batch_s": first}


# -- tensorstore --------------------------------------------------------------------------


def run_tensorstore(scn, samples: list, consume: Callable[[np.ndarray], None] | None = None, cache_bytes: int = 0) -> dict:
    """All reads of a batch are issued together in one ``ts.Batch`` (so reads of one shard
    share their index lookups), then awaited; a chunk cache of ``cache_bytes`` (default
    none); tensorstore casts to the output dtype (ts.cast) and the result is copied into the
    batch."""
    import tensorstore as ts

    t0 = time.perf_counter()
    ctx = ts.Context(
        {
            "cache_pool": {"total_bytes_limit": cache_bytes},
            "data_copy_concurrency": {"limit": CPUS},
            "file_io_concurrency": {"limit": max(4, CPUS)},
        }
    )
    arrays = {}
    first = None
    dtype = numpy_dtype(scn.dtype)
    out = np.empty((scn.samples_per_batch, *scn.sample_shape), dtype=dtype)
    for batch in batches_of(samples, scn.samples_per_batch):
        futures = []
        with ts.Batch() as tsbatch:
            for s in batch:
                arr = arrays.get(s.uri)
                if arr is None:
                    kvstore = {"driver": "http", "base_url": s.uri} if s.uri.startswith(("http://", "https://")) else {"driver": "file", "path": s.uri}
                    spec = {"driver": "zarr3", "kvstore": kvstore, "recheck_cached_data": False}
                    base = ts.open(spec, context=ctx, read=True).result()
                    arr = arrays[s.uri] = ts.cast(base, ts.float32) if dtype == np.float32 else base
                sel = _selection(s)
                view = arr[sel] if isinstance(s, damacy.Sample) else arr.oindex[sel]
                futures.append(view.read(batch=tsbatch))
        for i, f in enumerate(futures):
            out[i] = f.result()
        first = first or time.perf_counter() - t0
        if consume is not None:
            consume(out[: len(batch)])
    return {"seconds": time.perf_counter() - t0, "first_batch_s": first}


# -- the decode bound ------------------------------------------------------------------


def decode_bound(scn, samples: list) -> dict:
    """The time to decode, on all cores, every chunk each batch touches (once per batch), from
    bytes already in memory: the ceiling for a reader without a chunk cache."""
    import zstandard
    from numcodecs import blosc

    from damacy_server.plan.planner import Planner  # the planning machinery (damacy.ChunkPlanner is its settings)

    planner = Planner()
    encoded: list[bytes] = []
    codec = None
    for batch in batches_of(samples, scn.samples_per_batch):
        plan = planner.plan(batch, scn.sample_shape)
        assert not plan.errors, plan.errors
        for g in plan.groups:
            for u in g.units:
                data = u.meta.store.read_range(u.key, u.offset, u.nbytes) if u.nbytes >= 0 else u.meta.store.read(u.key)
                encoded.append(data)
                codec = u.meta.layout.leaf.b2b[-1].name if u.meta.layout.leaf.b2b else "bytes"
    decoded_bytes = [0] * CPUS
    cpu = [0.0] * CPUS

    def work(k: int) -> None:
        c0 = time.thread_time()
        d = zstandard.ZstdDecompressor()
        n = 0
        for data in encoded[k::CPUS]:
            n += len(d.decompress(data) if codec == "zstd" else blosc.decompress(data))
        decoded_bytes[k] = n
        cpu[k] = time.thread_time() - c0

    threads = [threading.Thread(target=work, args=(k,)) for k in range(CPUS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": sum(cpu), "chunks": len(encoded), "decoded_bytes": sum(decoded_bytes)}


READERS = {"damacy": run_damacy, "zarr-python": run_zarr, "tensorstore": run_tensorstore}
