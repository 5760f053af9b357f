"""The engine's per-batch work does no Python per read unit where it has moved off the
interpreter: units are named by numpy for a whole batch, the chunk cache is asked for a
batch's units by C loops, and units it holds are checked and copied by one native call."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import damacy
from damacy_server import native
from damacy_server.plan import units as plan_units
from damacy_server.plan.units import unit_key, unit_keys, unit_names

from conftest import random_data, write_array


def _meta(tmp_path, name: str, shape=(12, 20, 30), chunks=(4, 5, 6)):
    data = random_data(shape, "uint16", seed=len(name))
    write_array(tmp_path / name, data, chunks=chunks)
    return damacy.open_array(str(tmp_path / name)), data


def test_unit_keys_name_each_unit_of_an_array_version_once(tmp_path):
    a, _ = _meta(tmp_path, "a")
    b, _ = _meta(tmp_path, "b")
    units = np.indices(a.layout.grid).reshape(a.ndim, -1).T
    batch = unit_keys(a, units)  # an int64 array, for the chunk cache to look up as it is
    assert isinstance(batch, np.ndarray) and batch.dtype == np.int64
    keys = unit_names(batch)  # as Python holds them (the units in flight, per-unit jobs)
    assert len(set(keys)) == len(units) and all(type(k) is int for k in keys) and keys == batch.tolist()
    assert keys == [unit_key(a, tuple(u)) for u in units.tolist()]  # one unit's name is the batch form's
    assert unit_names(batch, np.array([3, 1])) == [keys[3], keys[1]]
    assert not set(keys) & set(unit_names(unit_keys(b, units)))  # another array: other names
    # a unit's name is its array version's token above UNIT_BITS and its C-order index below
    assert [k & ((1 << plan_units.UNIT_BITS) - 1) for k in keys] == list(range(len(units)))


def test_units_past_the_key_bits_are_named_by_tuples_and_read_the_same(tmp_path, monkeypatch):
    # an array of more units than UNIT_BITS numbers (here 4) is named by (token, index) pairs,
    # which are never equal to another array's ints; the cache serves them all the same
    meta, data = _meta(tmp_path, "big")
    monkeypatch.setattr(plan_units, "UNIT_BITS", 2)
    units = np.indices(meta.layout.grid).reshape(meta.ndim, -1).T
    keys = unit_keys(meta, units)
    assert all(isinstance(k, tuple) for k in keys) and len(set(keys)) == len(units)
    assert [k[1] for k in keys] == list(range(len(units)))
    assert unit_names(keys) == keys and unit_names(keys, np.array([2, 0])) == [keys[2], keys[0]]
    uri = str(tmp_path / "big")
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 10, 12), dtype="u16", chunk_cache_bytes=1 << 20, pop_timeout_s=30)
    samples = [damacy.Sample(uri, np.s_[1:5, 3:13, 7:19]), damacy.Sample(uri, np.s_[8:12, 10:20, 18:30])]
    with damacy.Pipeline(cfg) as pipe:
        pipe.push(samples)
        with pipe.pop() as first:  # decoded: its units are in the chunk cache
            got = [first.numpy().copy()]
        pipe.push(samples)  # planned after that (pushed together, it could be planned first)
        with pipe.pop() as second:
            got.append(second.numpy().copy())
        assert pipe.executor.chunk_cache.stats()["hits"] > 0
    want = np.stack([data[1:5, 3:13, 7:19], data[8:12, 10:20, 18:30]])
    assert all(np.array_equal(g, want) for g in got)


class _Calls:
    """Python function calls (not C ones) made while it counts (``counting``) by the thread
    that entered it and by every thread started after that."""

    def __init__(self, counting: bool = True) -> None:
        self.n = 0
        self.counting = counting
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg):
        if event == "call" and self.counting:
            with self._lock:
                self.n += 1

    def __enter__(self):
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def _calls_of_a_cached_batch(tmp_path, name: str, chunks: tuple[int, ...]) -> tuple[int, int]:
    """The Python calls made planning a batch of 4 samples whose units are all in the chunk
    cache and copying them (the second time: the first warms what is made once), and the
    units it cut; its values checked."""
    data = random_data((8, 64, 64), "uint16", seed=5)
    write_array(tmp_path / f"{name}.zarr", data, chunks=chunks)
    uri = str(tmp_path / f"{name}.zarr")
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(8, 48, 48), dtype="f32", chunk_cache_bytes=8 << 20, pop_timeout_s=30)
    samples = [damacy.Sample(uri, np.s_[:, y : y + 48, x : x + 48]) for y, x in ((0, 0), (16, 16), (8, 0), (16, 8))]
    with damacy.Pipeline(cfg) as pipe:
        pipe.push(samples)
        pipe.pop().release()  # fills the cache
        planner, executor = pipe.planner, pipe.executor
        out = np.zeros((4, 8, 48, 48), dtype=np.float32)
        done = threading.Event()

        def step():
            plan = planner.plan(
                samples, (8, 48, 48), "error", capacity=executor.inflight_capacity, cache=executor.chunk_cache,
                dtype=np.dtype("f4"), caps=executor.caps,
            )
            assert not plan.groups and sum(len(c.arrays) for c in plan.cached) == plan.units_unique
            done.clear()
            executor.execute(plan, list(out), lambda errors: done.set())
            assert done.wait(30)
            return plan

        step()
        with _Calls() as counted:
            plan = step()
    assert np.array_equal(out, np.stack([data[s.selection] for s in samples]).astype(np.float32))
    return counted.n, plan.units_unique


@pytest.mark.skipif(not native.available(), reason="the native extension is not built (the numpy path copies per unit)")
def test_a_cached_batch_is_planned_and_copied_without_python_per_unit(tmp_path):
    # two batches alike but for the units they cut (tens, and hundreds): planning them and
    # copying their units from the chunk cache makes as many Python calls
    few, few_units = _calls_of_a_cached_batch(tmp_path, "few", (8, 16, 16))
    lots, many_units = _calls_of_a_cached_batch(tmp_path, "many", (2, 8, 8))
    assert many_units >= 8 * few_units  # (the batches differ by hundreds of units)
    assert abs(lots - few) < 0.05 * few, (few, lots)  # no Python call per unit


def test_the_shards_a_sample_touches_are_counted_as_its_rows_distinct_shards(tmp_path):
    # PlanLimits.max_shards_per_sample: a sample's shards are counted from its selection as it
    # is added (per axis the shards it cuts, multiplied), never from the rows; the counts
    # equal np.unique over the (sample, shard) pairs of the rows it makes, for boxes partly
    # outside the array and index lists with repeats and unsorted positions
    from damacy_server.plan.rows import ArrayRows
    from damacy_server.plan.selection import resolve

    data = random_data((16, 24, 30), "uint16", seed=2)
    write_array(tmp_path / "s", data, chunks=(2, 3, 5), shards=(4, 6, 10))
    meta = damacy.open_array(str(tmp_path / "s"))
    per = np.asarray(meta.layout.units_per_chunk)
    rng = np.random.default_rng(4)
    for trial in range(60):
        acc = ArrayRows(meta, shard_limit=0)  # every sample that cuts a unit is kept with its count
        limited = ArrayRows(meta, shard_limit=3)
        for sample in range(int(rng.integers(1, 6))):
            selection = []
            for size in meta.shape:
                if rng.random() < 0.3:  # an index list: repeats, any order
                    selection.append(rng.integers(0, size, int(rng.integers(1, 8))).tolist())
                else:
                    start = int(rng.integers(-4, size))
                    selection.append(slice(start, start + int(rng.integers(1, 12))))
            axes, _ = resolve(tuple(selection), meta.shape, "pad")
            acc.add(sample, axes)
            limited.add(sample, axes)
        if not acc:
            assert acc.over == []
            continue
        rows, _, _ = acc.rows()
        pairs = np.unique(np.column_stack([rows[:, :1], rows[:, 1 : 1 + meta.ndim] // per]), axis=0)
        owners, counts = np.unique(pairs[:, 0], return_counts=True)
        assert dict(acc.over) == dict(zip(owners.tolist(), counts.tolist())), trial
        assert dict(limited.over) == {s: c for s, c in zip(owners.tolist(), counts.tolist()) if c > 3}, trial
    # an unsharded array counts nothing (each chunk is its own object, no shard index)
    write_array(tmp_path / "u", data, chunks=(4, 6, 10))
    plain = ArrayRows(damacy.open_array(str(tmp_path / "u")), shard_limit=0)
    plain.add(0, resolve(np.s_[0:16, 0:24, 0:30], data.shape, "pad")[0])
    assert plain.over == []


def _plan_summary(plan) -> dict:
    """What a BatchPlan tells its executor, in plain values: the reads and their units (where
    each is, its rows of its table), the cached units, the fills and the failed samples."""
    tables = {}

    def table(t) -> int:
        key = id(t)
        if key not in tables:
            tables[key] = (len(tables), t.rows.tolist(), t.pool.tolist(), t.spans.tolist())
        return tables[key][0]

    groups = [
        (g.key, g.offset, g.length, [(u.unit, u.key, u.offset, u.nbytes, table(u.table), u.pos, u.lo, u.hi, u.name) for u in g.units])
        for g in plan.groups
    ]
    cached = [(table(c.table), c.bounds.tolist(), c.coords.tolist(), [id(a) for a in c.arrays]) for c in plan.cached]
    return dict(
        groups=groups, cached=cached, tables=sorted(tables.values()), fills=plan.fills, errors=sorted(plan.errors),
        shapes=plan.shapes, transforms=plan.transforms, units=(plan.units_total, plan.units_unique, plan.reads_merged),
    )


@pytest.mark.skipif(not native.available(), reason="the native extension is not built")
def test_a_batch_planned_by_the_native_passes_equals_the_numpy_plan(tmp_path, monkeypatch):
    # random batches of boxes (some padded), index queries with repeats, flips and transposes
    # over several arrays (sharded, plain, with chunks never written), some units in the chunk
    # cache, some samples failing (too many shards): the plan the native passes make
    # (box_rows, unique_units, plan_table, merge_reads) is the plan numpy's forms make, to every value
    import zarr

    from damacy_protocol.limits import PlanLimits
    from damacy_server.cache import LRUCache
    from damacy_server.plan import rows as plan_rows
    from damacy_server.plan.planner import Planner

    shape = (10, 12, 14)
    write_array(tmp_path / "sharded", random_data(shape, "uint16", seed=1), chunks=(2, 3, 7), shards=(4, 6, 14))
    write_array(tmp_path / "plain", random_data(shape, "uint16", seed=2), chunks=(3, 4, 5))
    sparse = zarr.create_array(str(tmp_path / "sparse"), shape=shape, chunks=(5, 6, 7), dtype="uint16", fill_value=7)
    sparse[0:5, 0:6, :] = 3  # the other chunks are never written
    uris = [str(tmp_path / n) for n in ("sharded", "plain", "sparse")]
    planner = Planner()  # one resolver: the same metadata, so the same unit names, for both forms
    found = planner.metadata.arrays([(u, None) for u in uris])
    metas = {u: found[(u, None)] for u in uris}
    out = (3, 4, 5)
    rng = np.random.default_rng(11)
    natives = {name: getattr(native, name) for name in ("box_rows", "unique_units", "plan_table", "merge_reads")}
    seen: set = set()
    for trial in range(40):
        samples = []
        for _ in range(int(rng.integers(1, 9))):
            uri = uris[int(rng.integers(0, 3))]
            flip = tuple(sorted(set(rng.integers(0, 3, int(rng.integers(0, 3))).tolist())))
            order = tuple(rng.permutation(3).tolist()) if rng.random() < 0.3 else None
            want = out if order is None else tuple(out[a] for a in np.argsort(order))  # the selection's shape
            if rng.random() < 0.3:
                sel = tuple(rng.integers(0, s, n).tolist() for s, n in zip(shape, want))
                samples.append(damacy.IndexQuery(uri, sel, flip=flip, transpose=order))
            else:
                start = [int(rng.integers(-2, s)) for s in shape]
                samples.append(damacy.Sample(uri, tuple(slice(b, b + n) for b, n in zip(start, want)), flip=flip, transpose=order))
        cache = LRUCache(max_entries=10_000)
        for meta in metas.values():  # about half of each array's units in the cache
            units = np.indices(meta.layout.grid).reshape(meta.ndim, -1).T
            for key in np.asarray(unit_keys(meta, units), dtype=object)[rng.random(len(units)) < 0.5]:
                cache.put(key, np.zeros(meta.layout.unit_shape, dtype=meta.dtype))
        planner.limits = PlanLimits(max_shards_per_sample=int(rng.integers(1, 5)))
        plans = []
        for how in ("native", "numpy"):
            for name, fn in natives.items():
                monkeypatch.setattr(native, name, fn if how == "native" else (lambda *a, **k: None))
            plans.append(_plan_summary(planner.plan(samples, out, "pad", cache=cache)))
        assert plans[0] == plans[1], trial
        seen.update(k for k, v in plans[0].items() if v not in ([], {}, ()))
        seen.update(("failed",) if plans[0]["errors"] else ())
    assert plan_rows.native is native  # (the passes the forms were swapped in for)
    assert {"groups", "cached", "fills", "failed"} <= seen  # every part of a plan was compared, not empty


def _calls_planning_a_batch(tmp_path, name: str, chunks: tuple[int, ...]) -> tuple[int, int, int]:
    """The Python calls made planning a batch of 4 boxes of a sharded array none of whose
    units are cached (the second time: the first reads the shard indexes), the units it cut
    and the reads it made; the plan's reads checked against the units' places."""
    from damacy_server.plan.planner import Planner

    data = random_data((8, 64, 64), "uint16", seed=5)
    write_array(tmp_path / f"{name}.zarr", data, chunks=chunks, shards=(8, 32, 32))
    uri = str(tmp_path / f"{name}.zarr")
    samples = [damacy.Sample(uri, np.s_[:, y : y + 48, x : x + 48]) for y, x in ((0, 0), (16, 16), (8, 0), (16, 8))]
    planner = Planner()
    planner.plan(samples, (8, 48, 48), "error")
    with _Calls() as counted:
        plan = planner.plan(samples, (8, 48, 48), "error")
    units = [u for g in plan.groups for u in g.units]
    assert len(units) == plan.units_unique and len({u.name for u in units}) == len(units)
    for g in plan.groups:  # every read holds its units' bytes
        assert all(g.key == u.key and g.offset <= u.offset and u.offset + u.nbytes <= g.offset + g.length for u in g.units)
    return counted.n, plan.units_unique, len(plan.groups)


@pytest.mark.skipif(not native.available(), reason="the native extension is not built (the numpy form merges reads per unit)")
def test_a_batch_to_read_is_planned_without_python_per_unit(tmp_path):
    # two batches alike but for the units they cut (tens, and hundreds) in the same shards:
    # planning their reads (rows, units, places, merged reads) makes as many Python calls
    few, few_units, few_reads = _calls_planning_a_batch(tmp_path, "few", (8, 16, 16))
    lots, many_units, many_reads = _calls_planning_a_batch(tmp_path, "many", (2, 8, 8))
    assert many_units >= 8 * few_units  # (the batches differ by hundreds of units)
    assert many_reads == few_reads  # (a shard's units a batch needs are one read in both)
    assert abs(lots - few) < 0.05 * few, (few, lots)  # no Python call per unit


def _merge_reference(units, gap, most, most_units):
    """Reads as one would group them unit by unit (the rule merge_reads documents), from
    (owner, offset, nbytes) tuples: per read its units' indices, offset and length."""
    reads = []
    for i, (owner, off, nb) in enumerate(units):
        if nb < 0:
            reads.append(([i], 0, -1, None))
            continue
        last = reads[-1] if reads else None
        if last is not None and last[3] == owner and last[2] >= 0:
            idx, start, length, _ = last
            end = start + length
            if off - end <= gap and off + nb - start <= most and len(idx) < most_units:
                reads[-1] = (idx + [i], start, max(end, off + nb) - start, owner)
                continue
        reads.append(([i], off, nb, owner))
    return [(idx, start, length) for idx, start, length, _ in reads]


def test_reads_are_merged_as_the_rule_says_by_both_forms():
    # random units of a few objects in plan order (by object, then offset; some stored whole,
    # some overlapping, gaps of every size) and random caps: the native pass and numpy's form
    # group them as a unit-by-unit reading of the rule does
    from damacy_protocol.limits import PlanLimits
    from damacy_server.plan.reads import Caps, merge_reads, merge_reads_numpy
    from damacy_server.plan.units import UnitBlock

    rng = np.random.default_rng(3)
    forms = [("numpy", lambda *a: None)] + ([("native", native.merge_reads)] if native.available() else [])
    merged_some = whole_some = 0
    for trial in range(400):
        n = int(rng.integers(1, 40))
        owners = np.sort(rng.integers(0, 4, n)).astype(np.int64)
        offsets = np.zeros(n, dtype=np.int64)
        nbytes = rng.integers(1, 3000, n).astype(np.int64)
        for o in np.unique(owners):
            at = np.flatnonzero(owners == o)
            if rng.random() < 0.2:  # an object stored whole (an unsharded chunk)
                nbytes[at] = -1
            else:
                offsets[at] = np.sort(rng.integers(0, 20000, len(at)))
        gap, most, most_units = int(rng.integers(0, 3000)), int(rng.integers(1000, 20000)), int(rng.integers(1, 12))
        units = list(zip(owners.tolist(), offsets.tolist(), nbytes.tolist()))
        want = _merge_reference(units, gap, most, most_units)
        block = UnitBlock(
            None, None, 0, np.zeros((n, 1), np.int64), [f"/data/o{k}" for k in range(4)], owners, offsets, nbytes,
            np.zeros(n + 1, np.int64), list(range(n)),
        )
        limits = PlanLimits(max_gap_bytes=gap, max_read_bytes=most)
        for how, fn in forms:
            merge = native.merge_reads
            native.merge_reads = fn
            try:
                groups, saved = merge_reads(block, limits, Caps(max_units_per_read=most_units))
            finally:
                native.merge_reads = merge
            got = [(list(g.picks), g.offset, g.length) for g in groups]
            assert got == want, (trial, how)
            assert saved == n - len(want) and all(g.key == f"/data/o{owners[g.picks[0]]}" for g in groups)
        assert np.array_equal(merge_reads_numpy(owners, offsets, nbytes, gap, most, most_units)[0][-1:], [n])
        merged_some += any(len(idx) > 1 for idx, _, _ in want)
        whole_some += any(length < 0 for _, _, length in want)
    assert merged_some > 100 and whole_some > 50


def _calls_of_a_read_batch(tmp_path, name: str, chunks: tuple[int, ...], cache_bytes: int = 0) -> tuple[int, int, int, int]:
    """The Python calls made, by every thread of the pipeline (its feeder, I/O and decode
    threads are started while calls are watched), planning and executing a batch of 4 boxes
    of a sharded array, its bytes in the page cache (just written and read once), the units
    and reads it made, and the reads the decode threads made themselves; its values checked.
    With ``cache_bytes`` the executor has a chunk cache, emptied before the batch: every unit
    it decodes is offered to it and kept (the plan does not look it up)."""
    data = random_data((8, 64, 64), "uint16", seed=5)
    write_array(tmp_path / f"{name}.zarr", data, chunks=chunks, shards=(8, 32, 32))
    uri = str(tmp_path / f"{name}.zarr")
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(8, 48, 48), dtype="f32", pop_timeout_s=30, chunk_cache_bytes=cache_bytes)
    samples = [damacy.Sample(uri, np.s_[:, y : y + 48, x : x + 48]) for y, x in ((0, 0), (16, 16), (8, 0), (16, 8))]
    with _Calls(counting=False) as counted, damacy.Pipeline(cfg) as pipe:
        pipe.push(samples)
        pipe.pop().release()  # reads the shard indexes, and the data into the page cache
        planner, executor = pipe.planner, pipe.executor
        cache = executor.chunk_cache
        assert (cache is None) == (not cache_bytes)
        out = np.zeros((4, 8, 48, 48), dtype=np.float32)
        done = threading.Event()

        def step():
            plan = planner.plan(
                samples, (8, 48, 48), "error", capacity=executor.inflight_capacity, dtype=np.dtype("f4"), caps=executor.caps,
            )
            done.clear()
            executor.execute(plan, list(out), lambda errors: done.set())
            assert done.wait(30)
            return plan

        step()
        before = executor.stats.snapshot()["direct"]["count"]
        if cache is not None:
            cache.clear()
        counted.counting = True
        plan = step()
        counted.counting = False
        direct = executor.stats.snapshot()["direct"]["count"] - before
        if cache is not None:  # every unit decoded was kept
            assert len(cache) == plan.units_unique, (len(cache), plan.units_unique)
    assert np.array_equal(out, np.stack([data[s.selection] for s in samples]).astype(np.float32))
    return counted.n, plan.units_unique, len(plan.groups), direct


@pytest.mark.skipif(not native.available(), reason="the native extension is not built (the numpy path decodes per unit)")
def test_a_batch_read_from_the_page_cache_is_planned_and_executed_without_python_per_unit(tmp_path):
    # two batches alike but for the units they cut (tens, and hundreds) in the same shards,
    # read by the decode threads from the page cache: planning, reading, decoding and
    # assembling them makes as many Python calls in every thread
    few, few_units, few_reads, few_direct = _calls_of_a_read_batch(tmp_path, "few", (8, 16, 16))
    lots, many_units, many_reads, many_direct = _calls_of_a_read_batch(tmp_path, "many", (2, 8, 8))
    assert many_units >= 8 * few_units and many_reads == few_reads
    assert few_direct == few_reads and many_direct == many_reads  # (every read made by a decode thread itself)
    # no Python call per unit: one would add at least 220; the threads' turns (which takes a
    # job's next reads, how often a worker waits) vary the count by a few dozen between runs
    assert abs(lots - few) < 0.15 * few, (few, lots)


@pytest.mark.skipif(not native.available(), reason="the native extension is not built (the numpy path decodes per unit)")
def test_units_decoded_for_the_chunk_cache_are_offered_and_kept_without_python_per_unit(tmp_path):
    # the same two batches with a chunk cache: every unit is offered to it before it is
    # decoded whole and kept after, a native call per task (the cache's index in C), so the
    # calls do not grow with the units either
    few, few_units, few_reads, _ = _calls_of_a_read_batch(tmp_path, "few", (8, 16, 16), cache_bytes=64 << 20)
    lots, many_units, many_reads, _ = _calls_of_a_read_batch(tmp_path, "many", (2, 8, 8), cache_bytes=64 << 20)
    assert many_units >= 8 * few_units and many_reads == few_reads
    assert abs(lots - few) < 0.15 * few, (few, lots)


@pytest.mark.skipif(not native.available(), reason="the native extension is not built (no native copies)")
def test_a_cached_batch_is_copied_from_the_addresses_the_cache_kept(tmp_path, monkeypatch):
    # units decoded into the chunk cache are kept with their addresses; a batch that finds
    # them all there copies from those, asking no cached array for its buffer again
    data = random_data((8, 64, 64), "uint16", seed=6)
    write_array(tmp_path / "a.zarr", data, chunks=(4, 16, 16), shards=(8, 32, 32))
    uri = str(tmp_path / "a.zarr")
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 40, 40), dtype="f32", chunk_cache_bytes=64 << 20, pop_timeout_s=30)
    samples = [damacy.Sample(uri, np.s_[:, 3:43, 5:45]), damacy.Sample(uri, np.s_[:, 20:60, 0:40])]
    want = np.stack([data[s.selection] for s in samples]).astype(np.float32)
    asked = []
    real = native.decoded_sources
    monkeypatch.setattr(native, "decoded_sources", lambda kernel, arrays: asked.append(len(arrays)) or real(kernel, arrays))
    with damacy.Pipeline(cfg) as pipe:
        pipe.push(samples)
        with pipe.pop() as first:  # decoded, every unit kept
            assert np.array_equal(first.numpy(), want)
        cache = pipe.executor.chunk_cache
        hits = cache.stats()["hits"]
        pipe.push(samples)
        with pipe.pop() as second:  # every unit in the cache
            assert np.array_equal(second.numpy(), want)
        assert cache.stats()["hits"] - hits == len(cache) > 0
    assert asked == []
