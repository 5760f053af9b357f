"""Fuzz targets: properties that every input must satisfy, driven by hypothesis.

Each target is a function ``check(data)`` taking one generated input, and a strategy
(``STRATEGIES[name]``) that generates it. The rule is the same for all of them: an input
ends in a result or a clear damacy error (a :class:`damacy.DamacyError`, or ``ValueError``
for the native extension's table checks), never another exception, a crash, a hang or a
sanitizer report. Where an input is valid the result is also checked against a reference.

The tests (``tests/test_fuzz.py``) run each target for a short while in CI; ``python -m
fuzz TARGET --minutes N`` runs it for long, optionally with the native extensions built
under AddressSanitizer and UndefinedBehaviorSanitizer (``--sanitize``).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

import damacy
from damacy_server.plan.resolve import Resolver

_counter = itertools.count()

# -- JSON mutations ------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["", "uint8", "float32", ">u2", "<f8", "|b1", "zstd", "blosc", "bytes", "C", "F", "default", "v2", "regular", "sharding_indexed", "NaN", "Infinity", "0x7fc00000"]),
)
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)), max_leaves=12)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated_json(draw, base: dict) -> bytes:
    """``base`` with a few of its values (at any depth) replaced, removed or extended, or the
    document's bytes cut or flipped."""
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if not path:
            if action == "replace":
                doc = draw(_json)
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        if action == "delete":
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(_json)
        else:
            parent[key] = draw(_json)
    data = json.dumps(doc, allow_nan=True).encode()
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    if cut is not None and draw(st.booleans()):
        data = data[:cut]
    return data


V3 = {
    "zarr_format": 3, "node_type": "array", "shape": [6, 8], "data_type": "uint16",
    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
    "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
    "fill_value": 7,
    "codecs": [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [2, 2], "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": 0, "checksum": False}}],
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}], "index_location": "end"}}],
    "attributes": {},
}
V2 = {
    "zarr_format": 2, "shape": [6, 8], "chunks": [4, 4], "dtype": "<u2", "fill_value": 7, "order": "C",
    "compressor": {"id": "zstd", "level": 1}, "filters": [{"id": "delta", "dtype": "<u2"}], "dimension_separator": ".",
}


def _scratch() -> Path:
    root = Path(os.environ.get("DAMACY_FUZZ_DIR") or Path(tempfile.gettempdir()) / f"damacy-fuzz-{os.getpid()}")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _open_and_read(uri: str) -> None:
    """Open and read a corner of the array: a result or a damacy error."""
    metadata = Resolver()  # metadata with caches of its own: nothing cached across inputs
    try:
        meta = metadata.array(uri)
        if all(0 < n for n in meta.shape) and meta.ndim:
            damacy.read(uri, tuple(slice(0, 1) for _ in meta.shape), metadata=metadata)
    except damacy.DamacyError:
        pass


def _check_document(name: str, doc: bytes) -> None:
    """``doc`` as an array's metadata file ``name`` (zarr.json, .zarray), opened and read."""
    folder = _scratch() / f"doc-{next(_counter)}"
    folder.mkdir()
    try:
        (folder / name).write_bytes(doc)
        _open_and_read(str(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_zarr_json_v3(doc: bytes) -> None:
    _check_document("zarr.json", doc)


def check_zarr_json_v2(doc: bytes) -> None:
    _check_document(".zarray", doc)


# -- shard indexes and Blosc frames ---------------------------------------------------------------

_SHARDED: dict[str, Any] = {}


def sharded_array() -> tuple[Path, np.ndarray, bytes]:
    """A sharded array written by zarr-python (once per process): (folder, data, one shard's bytes)."""
    if not _SHARDED:
        import zarr
        from zarr.codecs import ZstdCodec

        folder = _scratch() / "sharded-base"
        shutil.rmtree(folder, ignore_errors=True)
        data = np.arange(6 * 8, dtype="uint16").reshape(6, 8) * 3
        arr = zarr.create_array(str(folder), shape=data.shape, chunks=(2, 2), shards=(4, 4), dtype=data.dtype, compressors=[ZstdCodec()], fill_value=7)
        arr[...] = data
        shard = folder / "c" / "0" / "0"
        _SHARDED.update(folder=folder, data=data, shard=shard.read_bytes())
    return _SHARDED["folder"], _SHARDED["data"], _SHARDED["shard"]


@st.composite
def mutated_bytes(draw, base: bytes, tail: int | None = None) -> bytes:
    """``base`` with bytes overwritten (in its last ``tail`` bytes when given), cut or extended."""
    data = bytearray(base)
    lo = max(0, len(data) - tail) if tail else 0
    for _ in range(draw(st.integers(0, 6))):
        if len(data) > lo:
            i = draw(st.integers(lo, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    how = draw(st.sampled_from(["keep", "keep", "cut", "extend"]))
    if how == "cut":
        data = data[: draw(st.integers(0, len(data)))]
    elif how == "extend":
        data += draw(st.binary(max_size=32))
    return bytes(data)


def check_shard_index(shard: bytes) -> None:
    folder, data, original = sharded_array()
    copy = _scratch() / f"shard-{next(_counter)}"
    shutil.copytree(folder, copy)
    try:
        (copy / "c" / "0" / "0").write_bytes(shard)
        try:
            got = damacy.read(str(copy), metadata=Resolver())
        except damacy.DamacyError:
            assert shard != original, "the unmodified shard failed"
            return
        if shard == original:
            assert np.array_equal(got, data)
        else:  # whatever a mutated index says, the other shards read as written
            assert np.array_equal(got[:, 4:], data[:, 4:]) and np.array_equal(got[4:, :4], data[4:, :4])
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def blosc_frames() -> list[tuple[bytes, np.ndarray]]:
    import numcodecs

    rng = np.random.default_rng(5)
    out = []
    for cname, shuffle, dtype in (("lz4", 1, "u2"), ("zstd", 2, "f4"), ("blosclz", 0, "u1"), ("zlib", 1, "i8")):
        values = (rng.poisson(40, size=700) + np.arange(700) % 5).astype(dtype)
        out.append((numcodecs.Blosc(cname=cname, clevel=5, shuffle=shuffle, blocksize=256).encode(values), values))
    return out


_FRAMES = []


def _frames():
    if not _FRAMES:
        _FRAMES.extend(blosc_frames())
    return _FRAMES


@st.composite
def mutated_frame(draw) -> tuple[int, bytes]:
    k = draw(st.integers(0, 3))
    return k, draw(mutated_bytes(_frames()[k][0]))


def check_blosc_frame(item: tuple[int, bytes]) -> None:
    """A frame through both of damacy's Blosc decoders: Python's (numcodecs' C-Blosc after
    damacy's frame checks) and the native loop (its own checks, then blosc_getitem)."""
    from damacy_server import native
    from damacy_server.zarr.codecs.base import CorruptData
    from damacy_server.zarr.codecs.blosc import BloscCodec

    k, frame = item
    original, values = _frames()[k]
    try:
        out = BloscCodec("lz4", 5, "shuffle", None).decode(frame, values.nbytes)
        if frame == original:
            assert bytes(out) == values.tobytes()
    except CorruptData:  # the codec's error (the unit's decoder names the chunk and file with it)
        assert frame != original
    if not native.available() or not native._blosc_available():
        return
    from damacy_server.native import _assemble

    n = len(values)
    out = np.full(n + 16, 0xAB, dtype=np.uint8).view(np.uint8)
    dst = np.zeros(n, dtype=values.dtype)
    guard = np.zeros(64, dtype=np.uint8)
    ops = np.array([[0, 0, 0, 0, n]], dtype=np.int64)
    targets = native.targets([dst], 1)
    failures = _assemble.run(frame, 0, np.array([[0, len(frame)]], dtype=np.int64), ops, 0, targets, np.array([n], dtype=np.int64),
                             native.dtype_code(values.dtype), native.dtype_code(values.dtype), 0, native.CODEC_BLOSC, values.nbytes, b"")[0]
    if frame == original:
        assert failures == [] and np.array_equal(dst, values)
    del out, guard


# -- the native extension's copy tables -----------------------------------------------------------

@st.composite
def copy_tables(draw) -> dict:
    ndim = draw(st.integers(1, 3))
    unit_shape = draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim))
    n_units = draw(st.integers(1, 3))
    n_targets = draw(st.integers(1, 3))
    big = st.one_of(st.integers(-8, 12), st.integers(-(2**63), 2**63 - 1))
    rows = draw(st.lists(st.lists(big, min_size=2 + 3 * ndim, max_size=2 + 3 * ndim), max_size=6))
    valid = draw(st.booleans())
    if valid:  # mostly in range: units and targets that exist, small extents
        for r in rows:
            r[0] = draw(st.integers(0, n_units - 1))
            r[1] = draw(st.integers(0, n_targets - 1))
        rows.sort(key=lambda r: r[0])
    pool = draw(st.lists(st.integers(-3, 10), max_size=8))
    out_shapes = [draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)) for _ in range(n_targets)]
    spans = draw(st.lists(st.tuples(st.integers(-2, 64), st.integers(-2, 64)), min_size=n_units, max_size=n_units))
    dtypes = draw(st.sampled_from([("uint16", "float32"), ("uint8", "uint8"), ("float32", "float16"), ("int16", "int64")]))
    norm = draw(st.booleans()) and dtypes[1].startswith("float")
    return dict(ndim=ndim, unit_shape=unit_shape, rows=rows, pool=pool, out_shapes=out_shapes, spans=spans, dtypes=dtypes, norm=norm, base=draw(st.integers(-1, 2)))


GUARD = 64


def check_copy_table(t: dict) -> None:
    """Random op tables through ``_assemble.run``: a ValueError (the tables refused), or
    failures for the units they cannot copy; never a write outside a target."""
    from damacy_server import native

    if not native.available():
        return
    from damacy_server.native import _assemble

    src, dst = np.dtype(t["dtypes"][0]), np.dtype(t["dtypes"][1])
    unit_elems = int(np.prod(t["unit_shape"]))
    data = np.arange(unit_elems * 4, dtype=src).tobytes()
    outs, arenas = [], []
    for shape in t["out_shapes"]:
        size = int(np.prod(shape)) * dst.itemsize
        arena = np.full(size + 2 * GUARD, 0x5A, dtype=np.uint8)
        arenas.append(arena)
        outs.append(arena[GUARD : GUARD + size].view(dst).reshape(shape))
    targets = native.targets(outs, t["ndim"], [(1.0, 0.5) if t["norm"] else None] * len(outs))
    try:
        _assemble.run(
            data, 0, np.array(t["spans"], dtype=np.int64), np.array(t["rows"], dtype=np.int64).reshape(-1, 2 + 3 * t["ndim"]),
            t["base"], targets, np.array(t["unit_shape"], dtype=np.int64), native.dtype_code(src), native.dtype_code(dst), 0,
            native.CODEC_RAW, unit_elems * src.itemsize, np.array(t["pool"], dtype=np.int64), b"",
        )
    except ValueError:
        pass
    for arena in arenas:
        assert np.all(arena[:GUARD] == 0x5A) and np.all(arena[len(arena) - GUARD :] == 0x5A), "a write outside its target"


@st.composite
def plan_passes(draw) -> dict:
    """Boxes, an array and its unit shape for the planner's native passes: mostly small and
    valid (boxes reaching into the array), sometimes out of the array or at int64's edges."""
    ndim = draw(st.integers(1, 4))
    edge = st.sampled_from([-(2**63), -(2**62) - 1, -(2**62), 2**62 - 1, 2**62, 2**62 + 1, 2**63 - 1])
    shape = draw(st.lists(st.one_of(st.integers(1, 12), st.integers(-1, 0), edge), min_size=ndim, max_size=ndim))
    unit = draw(st.lists(st.one_of(st.integers(1, 5), st.integers(-1, 0), edge), min_size=ndim, max_size=ndim))
    coord = st.one_of(st.integers(-4, 16), edge)
    boxes = [
        [draw(st.integers(0, 5))] + starts + [a + draw(st.one_of(st.integers(0, 6), edge)) for a in starts]
        for starts in draw(st.lists(st.lists(coord, min_size=ndim, max_size=ndim), max_size=5))
    ]
    return dict(shape=shape, unit=unit, boxes=[[max(-(2**63), min(2**63 - 1, v)) for v in b] for b in boxes])


def check_plan_passes(t: dict) -> None:
    """``box_rows`` and ``unique_units`` (native/plan.c) on any input: a ValueError (or
    MemoryError: too many rows), or the rows and units numpy's forms give (small inputs)."""
    from damacy_server import native
    from damacy_server.plan import rows as planner_rows

    if not native.available():
        return
    shape, unit = tuple(t["shape"]), tuple(t["unit"])
    boxes = np.array(t["boxes"], dtype=np.int64).reshape(-1, 1 + 2 * len(shape))
    try:
        rows = native.box_rows(boxes, shape, unit)
    except (ValueError, MemoryError):
        return
    small = all(0 < n <= 12 for n in shape) and all(0 < u <= 5 for u in unit) and np.abs(boxes).max(initial=0) <= 64
    if small:
        assert np.array_equal(rows, planner_rows.box_rows_numpy(boxes, shape, unit)), "box_rows differs from numpy"
    grid = tuple(-(-s // u) for s, u in zip(shape, unit))
    for cut in (rows, rows[::-1], rows[: len(rows) // 2]):
        try:
            units, inverse = native.unique_units(cut, 1, grid)
        except ValueError:
            assert not small, "unique_units refused the units of boxes inside the array"
            continue
        if small:
            want_units, want_inverse = planner_rows.unique_units_numpy(cut, grid)
            assert np.array_equal(units, want_units) and np.array_equal(inverse, want_inverse), "unique_units differs from numpy"
    # coordinates outside the grid, and grids of no units or of 2**62 and more, are refused
    bad = rows.copy()
    if len(bad):
        bad[0, 1] = grid[0]
        try:
            native.unique_units(bad, 1, grid)
            raise AssertionError("unique_units took a unit outside the grid")
        except ValueError:
            pass


@st.composite
def plan_tables(draw) -> dict:
    """One array's located units and rows for ``plan_table``: mostly valid (ties in owner and
    offset, units cached, missing, unused, samples dropped), sometimes a row's unit outside
    the units or per-unit columns of the wrong length."""
    ndim = draw(st.integers(0, 3))
    m = draw(st.integers(0, 12))
    n_rows = draw(st.integers(0, 40)) if m else 0
    samples = draw(st.integers(1, 6))
    small = st.integers(-3, 9)
    rows = [[draw(st.integers(0, samples - 1))] + [draw(small) for _ in range(4 * ndim)] for _ in range(n_rows)]
    inverse = [draw(st.integers(0, m - 1)) for _ in range(n_rows)]
    flags = lambda: [draw(st.booleans()) for _ in range(m)]  # noqa: E731
    t = dict(
        ndim=ndim, rows=rows, inverse=inverse,
        hit=draw(st.one_of(st.none(), st.builds(flags))), dropped=draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=samples, max_size=samples))),
        missing=flags(), owners=[draw(st.integers(-1, 2)) for _ in range(m)], offsets=[draw(st.integers(0, 3)) for _ in range(m)],
        nbytes=[draw(st.integers(-1, 9)) for _ in range(m)],
    )
    spoil = draw(st.sampled_from([None] * 6 + ["inverse", "owners", "hit"]))
    if spoil == "inverse" and n_rows:
        t["inverse"][draw(st.integers(0, n_rows - 1))] = draw(st.sampled_from([-1, m, m + 5]))
    elif spoil in ("owners", "hit"):  # one entry more than there are units
        t[spoil] = [0] * (m + 1)
    t["spoiled"] = spoil if spoil != "inverse" or n_rows else None
    return t


def check_plan_table(t: dict) -> None:
    """``plan_table`` (native/plan.c) on any input: a ValueError for rows naming no unit or
    per-unit columns of other lengths, else what numpy's form gives."""
    from damacy_server import native
    from damacy_server.plan import rows as planner_rows

    if not native.available():
        return
    ndim = t["ndim"]
    args = (
        np.array(t["rows"], dtype=np.int64).reshape(-1, 1 + 4 * ndim), ndim, np.array(t["inverse"], dtype=np.int64),
        None if t["hit"] is None else np.array(t["hit"], dtype=bool), None if t["dropped"] is None else np.array(t["dropped"], dtype=bool),
        np.array(t["missing"], dtype=bool), np.array(t["owners"], dtype=np.int64), np.array(t["offsets"], dtype=np.int64), np.array(t["nbytes"], dtype=np.int64),
    )
    try:
        got = native.plan_table(*args)
    except ValueError:
        assert t["spoiled"] is not None, "plan_table refused a valid table"
        return
    assert t["spoiled"] is None, f"plan_table took a table with {t['spoiled']} spoiled"
    want = planner_rows.plan_table_numpy(*args)
    names = ("order", "table", "spans", "bounds", "fills")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), f"plan_table's {name} differs from numpy: {g.tolist()} != {w.tolist()}"
    assert got[5] == want[5], "plan_table's count of cached units differs from numpy"


@st.composite
def file_jobs(draw) -> dict:
    """A job of reads of one file for ``file_job`` (native/job.c): mostly valid (each read's
    units in its range, ops on them), sometimes ranges past the file's end, spans outside
    their read, or bounds that do not hold every unit in order."""
    ndim = draw(st.integers(1, 2))
    unit_shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    n_reads = draw(st.integers(1, 4))
    per_read = [draw(st.integers(0, 3)) for _ in range(n_reads)]
    bounds = [0]
    for k in per_read:
        bounds.append(bounds[-1] + k)
    n_units = bounds[-1]
    unit_bytes = int(np.prod(unit_shape)) * 2
    spans = [(draw(st.integers(-1, 12)) * unit_bytes // 2, draw(st.sampled_from([unit_bytes, unit_bytes - 2, -1, 0]))) for _ in range(n_units)]
    reads = [(draw(st.integers(-2, 8 * unit_bytes)), draw(st.integers(-1, 16 * unit_bytes)), draw(st.booleans())) for _ in range(n_reads)]
    rows = []
    for u in range(n_units):
        for _ in range(draw(st.integers(0, 2))):
            src = [draw(st.integers(0, n - 1)) for n in unit_shape]
            ext = [draw(st.integers(0, n - a)) for n, a in zip(unit_shape, src)]
            dst = [draw(st.integers(-1, 3)) for _ in range(ndim)]
            rows.append([u, draw(st.integers(0, 1))] + src + [max(d, 0) for d in dst] + ext)
    spoil = draw(st.sampled_from([None] * 6 + ["short", "fall", "long"]))
    if spoil == "short":
        bounds[-1] -= 1
    elif spoil == "fall" and n_reads > 1:
        bounds[1], bounds[2] = bounds[2] + 1, bounds[1]
    elif spoil == "long":
        bounds[-1] += 1
    else:
        spoil = None
    spoiled = spoil is not None and bounds != sorted(bounds) or bounds[-1] != n_units or bounds[0] != 0
    return dict(ndim=ndim, unit_shape=unit_shape, bounds=bounds, spans=spans, reads=reads, rows=rows, threads=draw(st.integers(1, 3)), spoiled=spoiled)


def check_file_job(t: dict) -> None:
    """``file_job`` on any job: a ValueError (bounds or tables refused), or every read
    completed once (exactly one ``work`` call reports the last), each code run_file's, and
    never a write outside a target."""
    import threading

    from damacy_server import native

    if not native.available():
        return
    unit_shape = t["unit_shape"]
    unit_bytes = int(np.prod(unit_shape)) * 2
    path = _scratch() / "job.bin"
    if not path.exists():
        path.write_bytes(np.arange(8 * 64 * 4, dtype="<u2").tobytes())  # 16 units of the largest shape
    meta_kernel = native.NativeKernel(native.CODEC_RAW, native.dtype_code(np.dtype("u2")), native.dtype_code(np.dtype("f4")), False,
                                      np.array(unit_shape, dtype=np.int64), unit_bytes, np.dtype("u2"))
    outs, arenas = [], []
    for _ in range(2):
        size = 4 ** t["ndim"] * 4
        arena = np.full(size + 2 * GUARD, 0x5A, dtype=np.uint8)
        arenas.append(arena)
        outs.append(arena[GUARD : GUARD + size].view(np.float32).reshape((4,) * t["ndim"]))
    targets = native.targets(outs, t["ndim"])
    table = native.OpTable(
        np.array(t["rows"], dtype=np.int64).reshape(-1, 2 + 3 * t["ndim"]), t["ndim"], np.zeros(0, dtype=np.int64), 0,
        np.array(t["spans"], dtype=np.int64).reshape(-1, 2),
    )
    n = len(t["reads"])
    import os

    try:
        job = native.file_job(
            meta_kernel, (os.O_RDONLY | os.O_CLOEXEC, None), (os.fsencode(str(path)),) * n,
            np.array([r[0] for r in t["reads"]]), np.array([r[1] for r in t["reads"]]), np.array([r[2] for r in t["reads"]], dtype=np.uint8),
            np.array(t["bounds"]), table, targets,
        )
    except ValueError:
        return
    assert not t["spoiled"], f"file_job took bounds {t['bounds']}"
    lasts = []

    def work():
        more = True
        while more:
            last, more = job.work(False, 1)
            lasts.append(last)

    threads = [threading.Thread(target=work) for _ in range(t["threads"])]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert lasts.count(True) == 1, "not exactly one call completed the job"
    res = native.file_job_results(job)
    assert all(c in (0, -1, -2) for c in res.codes), f"unexpected codes {res.codes}"
    for arena in arenas:
        assert np.all(arena[:GUARD] == 0x5A) and np.all(arena[len(arena) - GUARD :] == 0x5A), "a write outside its target"


@st.composite
def cache_traces(draw) -> dict:
    """A trace of chunk-cache operations (lookups in batches, offers, puts, peeks, clears,
    discards) on a small cache bounded by entries or bytes, keys of one kind."""
    ops = draw(st.lists(st.tuples(st.sampled_from("gpwakcdWP"), st.lists(st.integers(0, 40), max_size=12), st.integers(0, 30)), max_size=60))
    return dict(
        ops=ops, entries=draw(st.sampled_from([None, 0, 1, 3, 8])), nbytes=draw(st.sampled_from([None, 0, 20, 60])),
        adaptive=draw(st.booleans()), kind=draw(st.sampled_from(["int", "tuple", "big"])),
    )


def check_cache_index(t: dict) -> None:
    """The native cache index (native/cache.c) against LRUCache on any trace: the same
    answers and the same state after every operation (under --sanitize, no memory error)."""
    from damacy_server import native
    from damacy_server.cache import INDEX_RULES, IndexedCache, LRUCache

    if not native.available():
        return
    entries, nbytes = t["entries"], t["nbytes"]
    if entries is None and nbytes is None:
        entries = 4
    sizeof = len if nbytes is not None else None
    ref = LRUCache(entries, max_bytes=nbytes, sizeof=sizeof, admit_by_frequency=t["adaptive"])
    nat = IndexedCache(native.cache_index(entries, nbytes, t["adaptive"], INDEX_RULES), sizeof=sizeof)
    name = {"int": lambda k: k, "tuple": lambda k: (k % 3, k), "big": lambda k: k << 70}[t["kind"]]
    for step, (op, raw, size) in enumerate(t["ops"]):
        keys = [name(k) for k in raw]
        # int keys fitting in 64 bits also as an int64 key array (the planner's form)
        fits = t["kind"] == "int" and all(-(1 << 63) <= k < 1 << 63 for k in keys)
        many = np.asarray(keys, dtype=np.int64) if fits and step % 2 else keys
        value = b"x" * size
        if op == "g":
            (m1, v1, _), (m2, v2, _) = nat.get_hits(many), ref.get_hits(many)
            assert m1.tolist() == m2.tolist() and v1 == v2, "get_hits differs"
        elif op == "p" and keys:
            assert nat.put(keys[0], value) == ref.put(keys[0], value), "put differs"
        elif op == "w" and keys:
            assert nat.would_admit(keys[0], size) == ref.would_admit(keys[0], size), "would_admit differs"
        elif op == "a":
            assert nat.peek_many(many) == ref.peek_many(many), "peek_many differs"
        elif op == "k":
            assert nat.has_room(size) == ref.has_room(size), "has_room differs"
        elif op == "W":
            assert nat.would_admit_many(many, size) == ref.would_admit_many(many, size), "would_admit_many differs"
        elif op == "P":
            values = [value] * len(keys)
            assert nat.put_many(many, values, size) == ref.put_many(many, values, size), "put_many differs"
        elif op == "c":
            nat.clear()
            ref.clear()
        elif op == "d":
            drop = set(keys).__contains__
            assert nat.discard_where(drop) == ref.discard_where(drop), "discard_where differs"
        assert nat.stats() == ref.stats() and nat.items() == ref.items(), "the entries differ"
        assert nat._index.shadow() == list(ref._shadow.items()) and nat._index.counts() == dict(ref._freq or {}), "admission state differs"


STRATEGIES = {
    "zarr_json_v3": (st.deferred(lambda: mutated_json(V3)), check_zarr_json_v3),
    "zarr_json_v2": (st.deferred(lambda: mutated_json(V2)), check_zarr_json_v2),
    "shard_index": (st.deferred(lambda: mutated_bytes(sharded_array()[2], tail=4 * 16 + 4)), check_shard_index),
    "blosc_frame": (st.deferred(mutated_frame), check_blosc_frame),
    "copy_table": (st.deferred(copy_tables), check_copy_table),
    "plan_passes": (plan_passes(), check_plan_passes),
    "plan_table": (plan_tables(), check_plan_table),
    "file_job": (file_jobs(), check_file_job),
    "cache_index": (cache_traces(), check_cache_index),
}
