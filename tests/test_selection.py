"""One meaning of a selection: the same entries select the same region in ``damacy.read``,
a :class:`Sample` and an :class:`IndexQuery`, in embedded and daemon pipelines alike.

``damacy.read`` is checked against numpy where numpy agrees (every position inside the
array), and everything against numpy on the array padded with its fill value (numbers are
array coordinates: a negative one is before the array, not counted from the end)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from zarr.codecs import BytesCodec, ShardingCodec, ZstdCodec

import damacy

from conftest import padded_selection, random_data, write_array

SHAPE = (12, 10, 9)
FILL = 5

#: (selection, accepted by Sample, inside the array)
TABLE = [
    (np.s_[2:6, 3:7, 0:4], True, True),
    (((2, 6), (3, 7), (0, 4)), True, True),  # a tuple is a range, as a slice
    (np.s_[-3:5, 8:14, 0:4], True, False),  # before the start and past the end: padded
    (np.s_[-1, 0:3, 0:3], True, False),  # -1 is before the array, not the last element
    (np.s_[5, 1:5, :], True, True),  # an integer drops its axis
    (np.s_[11, -2:3, 4], True, False),
    (np.s_[..., 2:6], True, True),  # ... stands for the axes not named
    (np.s_[3, ..., 4], True, True),
    (np.s_[:, 2:4], True, True),  # axes not named are whole
    (np.s_[0:12:3, 1:5, 2], False, True),  # a step: not a box
    (np.s_[-4:12:5, 1:5, 2], False, False),
    (([3, 1, 1, 11], np.s_[2:6], 0), False, True),  # a list is an index list
    (([3, -1, 12], (2, 6), 0), False, False),
    ((np.array([0, 7]), ..., [8, 0, 8]), False, True),
]


@pytest.fixture(scope="module")
def array(tmp_path_factory):
    root = tmp_path_factory.mktemp("selection")
    data = random_data(SHAPE, "uint16", seed=3)
    serializer = ShardingCodec(chunk_shape=(2, 5, 3), codecs=[BytesCodec(), ZstdCodec(level=1)])
    write_array(root / "a", data, chunks=(4, 10, 9), serializer=serializer, fill_value=FILL)
    return str(root / "a"), data


def numpy_oindex(data, sel):
    """numpy's own indexing, axis by axis (np.ix_), for selections inside the array."""
    entries = list(sel)
    if any(e is Ellipsis for e in entries):
        i = next(k for k, e in enumerate(entries) if e is Ellipsis)
        entries[i : i + 1] = [slice(None)] * (data.ndim - len(entries) + 1)
    entries += [slice(None)] * (data.ndim - len(entries))
    per_axis = []
    for e, n in zip(entries, data.shape):
        if type(e) is tuple:
            e = slice(*e)
        per_axis.append(np.arange(n)[e] if isinstance(e, slice) else np.atleast_1d(e))
    out = data[np.ix_(*per_axis)]
    return out.reshape([len(a) for e, a in zip(entries, per_axis) if not isinstance(e, int)])


def ids(table):
    return [repr(sel) for sel, _, _ in table]


@pytest.mark.parametrize("sel,boxed,inside", TABLE, ids=ids(TABLE))
def test_read(array, sel, boxed, inside):
    uri, data = array
    want = padded_selection(data, sel, FILL)
    assert np.array_equal(damacy.read(uri, sel, out_of_bounds="pad"), want)
    if inside:
        assert np.array_equal(damacy.read(uri, sel), numpy_oindex(data, sel))
    else:
        with pytest.raises(damacy.OutOfBounds, match="outside the array|leaves the array"):
            damacy.read(uri, sel)


def seed_index_selection(sel, shape):
    """``sel`` as an IndexQuery writes it (the seed API's form): per axis a slice with a stop
    and step one, or a list of positions (a strided slice, an integer as a one-position
    list keeping its axis); ``...`` and open bounds spelled out. Positions are the same
    array coordinates, so the region is the same (with the integers' axes kept)."""
    entries = list(sel if isinstance(sel, tuple) else (sel,))
    if any(e is Ellipsis for e in entries):
        i = next(k for k, e in enumerate(entries) if e is Ellipsis)
        entries[i : i + 1] = [slice(None)] * (len(shape) - len(entries) + 1)
    entries += [slice(None)] * (len(shape) - len(entries))
    out = []
    for e, n in zip(entries, shape):
        if type(e) is tuple:
            e = slice(*e)
        if isinstance(e, slice):
            start, stop = 0 if e.start is None else e.start, n if e.stop is None else e.stop
            out.append(slice(start, stop) if e.step in (None, 1) else list(range(start, stop, e.step)))
        elif isinstance(e, (int, np.integer)):
            out.append([int(e)])
        else:
            out.append([int(v) for v in e])
    return tuple(out)


@pytest.mark.parametrize("kind", ["Sample", "IndexQuery"])
def test_pipelines(array, make, kind):
    # a Sample takes damacy's numpy selection (a tuple); an IndexQuery the seed API's form
    # (seed_index_selection), whose negative positions it refuses; both read the same region
    uri, data = array
    for sel, boxed, _ in TABLE:
        if kind == "Sample" and not boxed:
            with pytest.raises((TypeError, ValueError), match="expected slice or \\(start, stop\\) tuple|slice step must be 1"):
                damacy.Sample(uri, sel)
            continue
        if kind == "Sample":
            want = padded_selection(data, sel, FILL)
            names_all = any(e is Ellipsis for e in sel) or len(sel) == len(SHAPE)
            sample = damacy.Sample(uri, sel if names_all else (*sel, ...))
            if not names_all:  # a sample names every axis of its array (or holds ...)
                cfg = damacy.Config(samples_per_batch=1, sample_shape=want.shape, dtype="native", pop_timeout_s=30)
                with make(cfg) as p:
                    p.push([damacy.Sample(uri, sel)])
                    with pytest.raises(damacy.RankMismatch):
                        p.pop()
        else:
            seed = seed_index_selection(sel, SHAPE)
            if any(isinstance(e, list) and min(e) < 0 or isinstance(e, slice) and e.start < 0 for e in seed):
                with pytest.raises(ValueError, match="nonnegative|invalid slice bounds"):
                    damacy.IndexQuery(uri, seed)
                continue
            sample = damacy.IndexQuery(uri, seed)
            want = padded_selection(data, seed, FILL)
        cfg = damacy.Config(samples_per_batch=1, sample_shape=want.shape, dtype="native", pop_timeout_s=30, out_of_bounds="pad")
        with make(cfg) as p:
            p.push([sample])
            with p.pop() as b:
                assert b.numpy().shape == (1, *want.shape), sel
                assert np.array_equal(b.numpy()[0], want), sel


def test_the_same_sample_means_the_same_region_in_read(array):
    uri, data = array
    for sel, boxed, _ in TABLE:
        seed = seed_index_selection(sel, SHAPE)
        queries = [] if any(isinstance(e, list) and min(e) < 0 or isinstance(e, slice) and e.start < 0 for e in seed) else [(damacy.IndexQuery(uri, seed), seed)]
        for sample, region in queries + ([(damacy.Sample(uri, sel), sel)] if boxed else []):
            # a sample's own selection reads back the same region
            got = damacy.read(uri, sample.selection, out_of_bounds="pad")
            assert np.array_equal(got, padded_selection(data, region, FILL)), sample


def test_shapes_and_equality(array):
    uri, _ = array
    assert damacy.Sample(uri, np.s_[5, 1:5, -2:7]).shape == (4, 9)
    assert damacy.Sample(uri, np.s_[..., 1:5]).shape is None  # depends on the array
    # an IndexQuery names every axis (a one-position list keeps its axis; a range is strided)
    q = damacy.IndexQuery(uri, ([3, 1, 1], [4], range(0, 9, 2)))
    assert q.shape == (3, 1, 5) and q.indices == ((3, 1, 1), (4,), (0, 2, 4, 6, 8))
    with pytest.raises(TypeError, match="got ellipsis"):
        damacy.IndexQuery(uri, (..., [1, 2]))
    assert damacy.Sample(uri, ((0, 4), 2)) == damacy.Sample(uri, np.s_[0:4, 2])
    assert damacy.IndexQuery(uri, (slice(0, 4),)) != damacy.IndexQuery(uri, ([0, 4],))  # range vs list
    assert damacy.IndexQuery(uri, ((0, 4),)) == damacy.IndexQuery(uri, ([0, 4],))  # a tuple is an index array
    assert repr(damacy.IndexQuery(uri, ([0, 4], [3], slice(0, 9)))) == f"IndexQuery({uri!r}, [[0, 4], [3], 0:9])"


@pytest.mark.parametrize(
    "sel,error,words,kinds",
    [
        (([0, 4], (0, 4)), TypeError, "aabb axis 0: expected slice or (start, stop) tuple; got list", "S"),
        (np.s_[0:8:2], ValueError, "slice step must be 1 or omitted (got step=2)", "S"),
        ((np.s_[0:8:2],), ValueError, "selection axis 0: slice step must be one", "I"),
        (((0, 1, 2),), TypeError, "aabb axis 0: expected slice or (start, stop) tuple; got tuple", "S"),
        ((np.zeros(4, bool),), TypeError, "an index array holds integers, got a bool array", "I"),
        ((np.s_[4:2],), ValueError, "selection axis 0: invalid slice bounds", "I"),
        (np.s_[..., 1, ...], damacy.InvalidArgument, "one '...'", "S"),
        (np.s_[..., 1, ...], TypeError, "selection axis 0: expected a slice or an iterable of indices, got ellipsis", "I"),
    ],
)
def test_refusals_say_what_to_use(array, sel, error, words, kinds):
    uri, _ = array
    for kind in [{"S": damacy.Sample, "I": damacy.IndexQuery}[k] for k in kinds]:
        with pytest.raises(error, match=re.escape(words)):
            kind(uri, sel)


def test_a_reversed_box_is_refused_at_push_and_a_tuple_is_an_index_array(array):
    uri, data = array
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(2, 10, 9), dtype="native")
    with damacy.Pipeline(cfg) as p:
        with pytest.raises(damacy.InvalidArgument, match=re.escape("the box [4, 2) is empty or reversed")):
            p.push([damacy.Sample(uri, np.s_[4:2, :, :])])
        q = damacy.IndexQuery(uri, ((0, 1, 2),))
        assert q.indices == ((0, 1, 2),) and q.shape == (3,)


def test_a_stride_is_checked_by_the_positions_it_selects(array):
    uri, data = array
    assert np.array_equal(damacy.read(uri, np.s_[0:14:5]), data[0:12:5])  # 0, 5, 10: inside
    with pytest.raises(damacy.OutOfBounds, match="0:14:3"):
        damacy.read(uri, np.s_[0:14:3])  # 12 is outside
    assert damacy.read(uri, np.s_[15:], out_of_bounds="pad").shape == (0, 10, 9)  # nothing past the end
    with pytest.raises(ValueError, match="slice stop is required"):  # an IndexQuery's slice has a stop
        damacy.IndexQuery(uri, (np.s_[15:], slice(0, 10), slice(0, 9)))
    with pytest.raises(damacy.OutOfBounds, match="15:"):
        damacy.read(uri, np.s_[15:])


@pytest.mark.parametrize("how", ["native", "numpy"])
def test_box_rows_are_each_box_cut_by_the_units_it_touches(how):
    # boxes become copy rows all at once (one native pass, or numpy without the native
    # module); each box's rows are the units it cuts in C order, with where the piece lies in
    # the unit and in the sample, as a per-box walk says; the distinct units they cut, and
    # each row's, are np.unique's
    import itertools

    from damacy_server import native
    from damacy_server.plan import rows as planner_rows

    if how == "native" and not native.available():
        pytest.skip("the native module is not built")
    _box_rows = native.box_rows if how == "native" else planner_rows.box_rows_numpy

    rng = np.random.default_rng(3)
    for _ in range(200):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(x) for x in rng.integers(1, 30, ndim))
        unit = tuple(int(x) for x in rng.integers(1, 9, ndim))
        boxes, want = [], []
        for sample in range(int(rng.integers(1, 6))):
            start = [int(rng.integers(-5, s)) for s in shape]
            stop = [max(b + 1, int(rng.integers(1, s + 6))) for b, s in zip(start, shape)]
            if any(max(b, 0) >= min(e, s) for b, e, s in zip(start, stop, shape)):
                continue  # wholly outside: no rows (the planner pads it)
            boxes.append((sample, *start, *stop))
            per_axis = []
            for b, e, s, u in zip(start, stop, shape, unit):
                lo, hi = max(b, 0), min(e, s)
                per_axis.append([(k, max(lo, k * u) - k * u, max(lo, k * u) - b, min(hi, (k + 1) * u) - max(lo, k * u)) for k in range(lo // u, (hi - 1) // u + 1)])
            for parts in itertools.product(*per_axis):
                want.append([sample, *[p[c] for c in range(4) for p in parts]])
        if not boxes:
            continue
        got = _box_rows(np.array(boxes, dtype=np.int64), shape, unit)
        assert got.tolist() == want
        grid = tuple(-(-s // u) for s, u in zip(shape, unit))
        units, inverse = native.unique_units(got, 1, grid) if how == "native" else planner_rows.unique_units_numpy(got, grid)
        want_units, want_inverse = np.unique(got[:, 1 : 1 + ndim], axis=0, return_inverse=True)
        assert units.tolist() == want_units.tolist() and inverse.tolist() == want_inverse.reshape(-1).tolist()


def test_an_array_as_long_as_zarr_metadata_allows_reads_its_last_rows_and_pads_past_them(tmp_path):
    # an axis of 2**62 - 8 (the metadata's limit is 2**62 - 1): the planner's native passes
    # take coordinates that large (their limit is 2**62) and read what zarr-python wrote there
    import zarr

    n = 2**62 - 8
    a = zarr.create_array(str(tmp_path / "a"), shape=(n, 8), chunks=(4, 8), dtype="uint16", fill_value=FILL)
    a[n - 6 : n] = np.arange(48, dtype="uint16").reshape(6, 8)
    uri = str(tmp_path / "a")
    cfg = damacy.Config(samples_per_batch=3, sample_shape=(4, 8), dtype="u16", out_of_bounds="pad")
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(uri, np.s_[n - 4 : n, :]), damacy.Sample(uri, np.s_[0:4, :]), damacy.Sample(uri, np.s_[n - 2 : n + 2, :])])
        with p.pop() as b:
            got = b.numpy().copy()
            assert b.info.errors == ()
    assert np.array_equal(got[0], a[n - 4 : n]) and np.all(got[1] == FILL)
    assert np.array_equal(got[2][:2], a[n - 2 : n]) and np.all(got[2][2:] == FILL)


def test_an_array_of_more_axes_than_native_code_takes_is_planned_by_numpy(tmp_path):
    # 9 axes (native code takes up to 8): the planner's passes fall back to numpy, and boxes
    # (padded past the end too) read what zarr-python reads
    import zarr

    shape = (3, 2, 2, 2, 2, 2, 2, 2, 4)
    data = random_data(shape, "uint16", 9)
    write_array(tmp_path / "a", data, chunks=(2, 1, 2, 1, 2, 1, 2, 1, 3), fill_value=FILL)
    uri = str(tmp_path / "a")
    boxes = [np.s_[0:2, :, :, :, :, :, :, :, 1:3], np.s_[2:4, :, :, :, :, :, :, :, 2:4]]
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(2, *shape[1:8], 2), dtype="u16", out_of_bounds="pad")
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(uri, b) for b in boxes])
        with p.pop() as b:
            got = b.numpy().copy()
            assert b.info.errors == ()
    a = zarr.open_array(uri, mode="r")
    assert np.array_equal(got[0], a[boxes[0]])
    assert np.array_equal(got[1][:1], a[2:3, ..., 2:4]) and np.all(got[1][1:] == FILL)  # row 3 is past the end


def test_boxes_and_index_lists_of_one_array_keep_sample_order(tmp_path):
    # a batch mixing boxes (their rows made together) and an index query (its rows made on
    # its own) plans each unit's copies in sample order, and reads what zarr-python reads
    import zarr

    data = random_data(SHAPE, "int16", 4)
    write_array(tmp_path / "a", data, chunks=(4, 4, 4), fill_value=FILL)
    uri = str(tmp_path / "a")
    samples = [
        damacy.Sample(uri, np.s_[0:4, 2:6, 1:5]),
        damacy.IndexQuery(uri, (np.array([7, 1, 3, 2]), slice(2, 6), slice(5, 9))),
        damacy.Sample(uri, np.s_[-2:2, 6:10, 5:9]),  # pads
    ]
    from damacy_server.plan.planner import Planner

    plan = Planner().plan(samples, (4, 4, 4))
    table = plan.groups[0].units[0].table
    assert {u.table is table for g in plan.groups for u in g.units} == {True}
    for unit_rows in np.split(table.rows, np.flatnonzero(np.diff(table.rows[:, 0])) + 1):
        assert unit_rows[:, 1].tolist() == sorted(unit_rows[:, 1].tolist())
    assert sorted(set(table.rows[:, 1].tolist())) == [0, 1, 2]
    z = zarr.open_array(uri, mode="r")
    want = [z[0:4, 2:6, 1:5], z.oindex[[7, 1, 3, 2], 2:6, 5:9], padded_selection(data, np.s_[-2:2, 6:10, 5:9], FILL)]
    with damacy.Pipeline(damacy.Config(samples_per_batch=3, sample_shape=(4, 4, 4), dtype="i16", out_of_bounds="pad")) as p:
        p.push(samples)
        with p.pop() as batch:
            for got, w in zip(batch.numpy(), want):
                assert np.array_equal(got, w)


def test_flip_and_transpose_take_any_integers_and_refuse_the_rest(array):
    path, data = array
    box = np.s_[0:4, 0:5, 0:6]
    want = np.flip(padded_selection(data, box), 0)
    for flip in (np.array([0]), 0, [np.int64(0)], (0, 0)):  # an array or a lone 0 was dropped (falsy)
        s = damacy.Sample(path, box, flip=flip)
        assert s.flip == (0,)
        cfg = damacy.Config(samples_per_batch=1, sample_shape=(4, 5, 6), dtype=data.dtype.name)
        with damacy.Pipeline(cfg) as pipe:
            pipe.push([s])
            np.testing.assert_array_equal(next(iter(pipe)).copy()[0], want)
    for bad in ((1.7,), (float("inf"),), (True,), "ab"):
        with pytest.raises(damacy.InvalidArgument, match="flip"):
            damacy.Sample(path, box, flip=bad)
    with pytest.raises(damacy.InvalidArgument, match="transpose"):
        damacy.Sample(path, box, transpose=(1.9, 0.2, 2))  # truncated to (1, 0, 2) before
    assert damacy.Sample(path, box, transpose=np.array([2, 0, 1])).transpose == (2, 0, 1)
    with pytest.raises(damacy.InvalidArgument, match="normalize"):
        damacy.Sample(path, box, normalize=(0, 10**400))


def test_a_relative_path_with_a_colon_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_array(tmp_path / "run-10:00.zarr", np.arange(4, dtype="u1"), chunks=(4,))
    np.testing.assert_array_equal(damacy.read("run-10:00.zarr"), np.arange(4, dtype="u1"))
    with pytest.raises(damacy.UnsupportedOperation, match="'foo'://"):
        damacy.read("foo://bucket/a.zarr")


def test_refused_files_leave_no_descriptor_open_without_the_native_module(tmp_path, monkeypatch):
    import os

    import damacy_server.store.file as file

    monkeypatch.setattr(file, "_open_checked", None)  # the numpy path's own open
    (tmp_path / "a-folder").mkdir()
    os.mkfifo(tmp_path / "a-fifo")
    store = file.FileStore()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        for name in ("a-folder", "a-fifo"):
            with pytest.raises(damacy.StorageError):
                store.read(str(tmp_path / name))
    assert len(os.listdir("/proc/self/fd")) <= before + 2
