"""Caches that outlive a run see arrays re-created in storage: metadata cached before a daemon
session (or a ``damacy.read``) began is checked against storage once, and an array whose
metadata document changed is read anew, its shard indexes and decoded chunks with it."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zarr
from numcodecs import Zstd
from zarr.codecs import ZstdCodec

import damacy
from damacy_server.plan.planner import Planner
from damacy_server.plan.resolve import Resolver
from damacy_server.plan.versions import Seen
from damacy_server.store import FileStore

from daemon_helpers import DaemonProcess

SHAPE = (16, 24, 20)


def create(path, seed: int, *, fmt: int = 3, shape=SHAPE) -> np.ndarray:
    """(Re-)create the array at ``path`` with zarr-python, as a script that writes a dataset
    again does: same path, same layout (sharded in v3), other values."""
    # (values whose compressed sizes differ by seed: a stale shard index reads them wrong)
    data = np.random.default_rng(seed).integers(0, min(16**seed, 60000), size=shape, dtype="uint16")
    kwargs = {"shards": (8, 24, 20), "compressors": [ZstdCodec(level=1)]} if fmt == 3 else {"compressors": [Zstd(level=1)]}
    arr = zarr.create_array(str(path), shape=shape, dtype="uint16", chunks=(4, 12, 10), zarr_format=fmt, overwrite=True, **kwargs)
    arr[...] = data
    return data


@pytest.mark.parametrize("fmt", [2, 3])
def test_read_sees_an_array_recreated_in_place(tmp_path, fmt):
    uri = tmp_path / "a.zarr"
    first = create(uri, 1, fmt=fmt)
    assert np.array_equal(damacy.read(uri), first)
    second = create(uri, 2, fmt=fmt)
    assert np.array_equal(damacy.read(uri), second)  # not the first's shard indexes or metadata
    third = create(uri, 3, fmt=fmt, shape=(8, 24, 20))  # another shape
    assert np.array_equal(damacy.read(uri), third)


def test_an_image_recreated_in_place_is_read_anew(tmp_path):
    from test_ngff import pyramid

    path = tmp_path / "img.zarr"
    uri, before = pyramid(path, 3, levels=2)
    assert np.array_equal(damacy.read(uri, level=1), before[1])
    uri, after = pyramid(path, 3, levels=2, size=16)  # smaller levels
    assert not np.array_equal(after[1].shape, before[1].shape)
    assert np.array_equal(damacy.read(uri, level=1), after[1])
    assert damacy.open_image(uri).levels[0].shape == after[0].shape


def test_a_planner_asks_storage_once_for_what_was_cached_before_it(tmp_path):
    uri = str(tmp_path / "a.zarr")
    create(uri, 1)
    md = Resolver()
    md.array(uri)  # cached by an earlier run
    sample = damacy.Sample(uri, np.s_[0:4, 0:12, 0:10])
    planner = Planner(md, fresh_after=time.monotonic())
    for _ in range(3):
        plan = planner.plan([sample, sample], (4, 12, 10))
        assert not plan.errors
    assert (md.rechecked, md.changed) == (1, 0)  # once, for both samples and all batches
    old = md.array(uri)
    create(uri, 2, shape=(12, 24, 20))
    Planner(md).plan([sample], (4, 12, 10))  # no recheck: the cached metadata as it is
    assert md.array(uri) is old and md.changed == 0
    plan = Planner(md, fresh_after=time.monotonic()).plan([sample], (4, 12, 10))
    new = md.array(uri)
    assert not plan.errors and md.changed >= 1 and new.shape == (12, 24, 20)
    # what caches hold of its data is named by its version: the old array's entries are others
    assert new.generation != old.generation and new.version != old.version
    assert {k[3] for k in md.cache.shard_indexes._data} == {old.generation, new.generation}


def test_an_array_read_again_unchanged_keeps_its_name_in_the_caches(tmp_path):
    uri = str(tmp_path / "a.zarr")
    create(uri, 1)
    md = Resolver()
    first = md.array(uri)
    md.forget(md.store_of(uri)[1])  # (as an eviction from the metadata cache would)
    again = md.array(uri)
    assert again is not first and again.generation == first.generation != 0
    assert Resolver(recheckable=False).array(uri).generation == 0  # no versions asked


def test_a_load_that_began_before_a_recheck_does_not_replace_what_it_read(tmp_path):
    """Two planning threads share the metadata (a daemon's): one began reading the array
    before it was re-created, another (a session opened after) rechecked and read the new
    one; the first, finishing last, keeps the newer entry, not what it read."""
    uri = str(tmp_path / "a.zarr")
    create(uri, 1)
    md = Resolver()
    store, root = md.store_of(uri)
    stale = md._load(store, root, uri, docs := [])  # read, not yet kept
    began = time.monotonic() - 1.0  # its reading began before what follows
    create(uri, 2, shape=(12, 24, 20))
    assert md.array(uri).shape == (12, 24, 20)  # the other thread reads the new array
    kept = md._keep(root, stale, Seen(store, tuple(docs), began))
    assert kept.shape == (12, 24, 20) and md.array(uri).shape == (12, 24, 20)
    # or finishing after the other forgot the old array and before it read the new one
    stale = md._load(store, root, uri, docs := [])
    began = time.monotonic()
    create(uri, 3, shape=(8, 24, 20))
    md.recheck([(uri, None)], time.monotonic())
    assert md._peek(root) is None  # forgotten, not read yet
    md._keep(root, stale, Seen(store, tuple(docs), began))
    assert md.array(uri).shape == (8, 24, 20)


def test_a_version_that_could_not_be_asked_is_asked_again(tmp_path, monkeypatch):
    """A failed version request when an array loads (a timeout, a refused HEAD) leaves it
    unknown, not "never changes": the next check asks again and, once it is known, reads the
    array anew."""
    uri = str(tmp_path / "a.zarr")
    first = create(uri, 1)
    md = Resolver()
    real, fails = FileStore.version, [1]

    def flaky(self, key):
        if fails[0]:
            fails[0] -= 1
            raise damacy.StorageError("timed out", path=key)
        return real(self, key)

    monkeypatch.setattr(FileStore, "version", flaky)
    assert np.array_equal(damacy.read(uri, metadata=md), first)
    second = create(uri, 2)
    assert np.array_equal(damacy.read(uri, metadata=md), second)


def test_read_checks_the_level_a_scale_picks_and_refuses_a_bad_level_first(tmp_path):
    from test_ngff import pyramid

    uri, data = pyramid(tmp_path / "img.zarr", 3, levels=2)
    md = Resolver()
    assert np.array_equal(damacy.read(uri, scale=[2.0, 1.0, 1.0], metadata=md), data[1])
    level1 = np.full((2, 8, 16, 16), 7, dtype="uint16")
    zarr.create_array(f"{uri}/s1", shape=level1.shape, chunks=(1, 4, 8, 8), dtype="uint16", overwrite=True)[...] = level1
    assert np.array_equal(damacy.read(uri, scale=[2.0, 1.0, 1.0], metadata=md), level1)
    for bad in ([0], "1", 1.5):
        with pytest.raises(damacy.InvalidArgument, match="level must be a non-negative integer"):
            damacy.read(uri, level=bad, metadata=md)


def ngff(path, seed: int, *, size: int = 32, fmt: int = 3, consolidate: bool = False, mode: str = "w") -> list[np.ndarray]:
    """A 2-level (y, x) image written (again) with zarr-python; the levels' sizes compressed
    differ by seed (a stale shard index reads wrong)."""
    group = zarr.open_group(str(path), mode=mode, zarr_format=fmt)
    axes = [{"name": "y", "type": "space"}, {"name": "x", "type": "space"}]
    datasets = [{"path": f"s{k}", "coordinateTransformations": [{"type": "scale", "scale": [2.0**k] * 2}]} for k in range(2)]
    if fmt == 3:
        group.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": datasets}]}
    else:
        group.attrs["multiscales"] = [{"version": "0.4", "axes": axes, "datasets": datasets}]
    levels = []
    for k in range(2):
        n = size >> k
        values = np.random.default_rng(seed).integers(0, 4**seed, size=(n, n), dtype="uint16")
        kw = {"shards": (8, n), "compressors": [ZstdCodec(level=1)]} if fmt == 3 else {}
        group.create_array(f"s{k}", shape=values.shape, chunks=(4, 4), dtype="uint16", overwrite=True, **kw)[...] = values
        levels.append(values)
    if consolidate:
        zarr.consolidate_metadata(str(path))
    return levels


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
def test_image_levels_are_checked_however_they_were_cached(tmp_path):
    path = tmp_path / "img.zarr"
    uri = str(path)
    # a level described by the image's consolidated metadata, then named by its own path
    md = Resolver()
    first = ngff(path, 1, consolidate=True)
    assert np.array_equal(damacy.read(uri, level=0, metadata=md), first[0])
    second = ngff(path, 2, consolidate=True)
    assert np.array_equal(damacy.read(uri + "/s0", metadata=md), second[0])
    # a level cached by its own path, then its image (not cached) read by level
    md = Resolver()
    assert np.array_equal(damacy.read(uri + "/s0", metadata=md), second[0])
    third = ngff(path, 3, size=16)
    assert np.array_equal(damacy.read(uri, level=0, metadata=md), third[0])
    # a level written again alone: the image read without a level (its level 0), by level,
    # and the image's description of its levels
    md = Resolver()
    assert np.array_equal(damacy.read(uri, metadata=md), third[0])
    assert np.array_equal(damacy.read(uri, level=1, metadata=md), third[1])
    level0 = np.random.default_rng(9).integers(0, 9, size=(8, 8), dtype="uint16")
    level1 = np.random.default_rng(9).integers(0, 99, size=(4, 4), dtype="uint16")
    for name, values in (("s0", level0), ("s1", level1)):
        zarr.create_array(f"{uri}/{name}", shape=values.shape, chunks=(4, 4), shards=(4, 4), dtype="uint16",
                          compressors=[ZstdCodec(level=1)], overwrite=True)[...] = values
    assert np.array_equal(damacy.read(uri, metadata=md), level0)
    assert np.array_equal(damacy.read(uri, level=1, metadata=md), level1)
    assert [lv.shape for lv in md.image(uri).levels] == [(8, 8), (4, 4)]


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
def test_a_v2_image_is_checked_by_its_attributes_and_consolidated_metadata(tmp_path):
    """NGFF 0.4 keeps the multiscales in .zattrs and a consolidated group its levels in
    .zmetadata; a writer may rewrite them and leave .zgroup as it was."""
    import shutil

    uri = str(tmp_path / "img.zarr")
    md = Resolver()
    first = ngff(tmp_path / "img.zarr", 1, fmt=2, consolidate=True)
    assert np.array_equal(damacy.read(uri, level=0, metadata=md), first[0])
    second = ngff(tmp_path / "new.zarr", 2, fmt=2, consolidate=True, size=16)
    for name in ("s0", "s1"):
        shutil.rmtree(tmp_path / "img.zarr" / name)
        shutil.copytree(tmp_path / "new.zarr" / name, tmp_path / "img.zarr" / name)
    for name in (".zattrs", ".zmetadata"):
        shutil.copy(tmp_path / "new.zarr" / name, tmp_path / "img.zarr" / name)
    assert np.array_equal(damacy.read(uri, level=0, metadata=md), second[0])


def test_a_daemon_session_reads_an_array_recreated_since_the_last(tmp_path):
    """The daemon's metadata, shard-index and chunk caches outlive sessions: a session opened
    after the array was written again reads the new values, though every chunk it reads was
    in the chunk cache."""
    data = tmp_path / "data"
    uri = str(data / "a.zarr")
    first = create(uri, 1)
    proc = DaemonProcess(tmp_path, [data], extra=["--chunk-cache", "64M"])
    try:
        cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 24, 20), dtype="u16", pop_timeout_s=60)
        samples = [damacy.Sample(uri, np.s_[0:8, :, :]), damacy.Sample(uri, np.s_[8:16, :, :])]

        def session() -> np.ndarray:
            with damacy.Pipeline(cfg, endpoint=proc.endpoint) as p:
                p.push(samples)
                with p.pop() as b:
                    assert b.info.errors == ()
                    return b.numpy().copy()

        assert np.array_equal(session(), first.reshape(2, 8, 24, 20))
        assert np.array_equal(session(), first.reshape(2, 8, 24, 20))  # from the chunk cache
        second = create(uri, 2)
        assert np.array_equal(session(), second.reshape(2, 8, 24, 20))
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


def test_versions_not_all_asked_never_share_a_number_and_the_numbers_are_bounded():
    from damacy_server.plan.versions import UNKNOWN, Generations

    g = Generations(most=2)
    known = ("zarr.json", (1, 2, 3))
    assert g.of("/a", None) == 0 and g.of("/a", (known,)) == g.of("/a", (known,))
    assert g.of("/a", (UNKNOWN,)) != g.of("/a", (UNKNOWN,))  # two reads that could not be asked
    first = g.of("/a", (known,))
    g.of("/b", (known,))
    g.of("/c", (known,))  # past the bound: the oldest number goes
    assert g.of("/a", (known,)) != first and len(g._numbers) == 2


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
def test_a_plate_written_again_is_not_read_from_its_old_consolidated_metadata(tmp_path):
    """An image under a plate is read from the plate's consolidated metadata: a read after
    the plate was written again checks that too."""
    def plate(seed: int, size: int) -> tuple[str, list[np.ndarray]]:
        group = zarr.open_group(str(tmp_path / "p.zarr"), mode="w")
        group.attrs["ome"] = {"version": "0.5", "plate": {
            "rows": [{"name": "A"}], "columns": [{"name": "1"}], "wells": [{"path": "A/1", "rowIndex": 0, "columnIndex": 0}]}}
        group.require_group("A").require_group("1").attrs["ome"] = {"version": "0.5", "well": {"images": [{"path": "0"}]}}
        levels = ngff(tmp_path / "p.zarr" / "A" / "1" / "0", seed, size=size)
        zarr.consolidate_metadata(str(tmp_path / "p.zarr"))
        return str(tmp_path / "p.zarr" / "A" / "1" / "0"), levels

    md = Resolver()
    field, _ = plate(1, 32)
    damacy.open_plate(str(tmp_path / "p.zarr"), metadata=md)  # its consolidated metadata cached
    field, second = plate(2, 16)
    assert np.array_equal(damacy.read(field, level=0, metadata=md), second[0])


def test_a_level_written_after_its_image_was_read_is_read_then(tmp_path):
    import shutil

    path = tmp_path / "img.zarr"
    levels = ngff(path, 1)
    shutil.move(str(path / "s1"), str(tmp_path / "s1"))  # a writer not done yet
    md = Resolver()
    assert np.array_equal(damacy.read(str(path), level=0, metadata=md), levels[0])
    with pytest.raises(damacy.NotFound):
        damacy.read(str(path), level=1, metadata=md)
    shutil.move(str(tmp_path / "s1"), str(path / "s1"))  # done
    assert np.array_equal(damacy.read(str(path), level=1, metadata=md), levels[1])


def test_a_session_opened_while_another_checks_checks_again(tmp_path, monkeypatch):
    """Session A's check asked an array's version (the old one); the array is re-created and
    session B opens before A's check ends: B checks it again, not taking A's for its own."""
    import threading

    uri = str(tmp_path / "a.zarr")
    create(uri, 1)
    md = Resolver()
    md.array(uri)  # cached by an earlier session
    asked, go = threading.Event(), threading.Event()
    real = FileStore.version

    def version(self, key):
        found = real(self, key)
        if threading.current_thread().name == "A":
            asked.set()
            assert go.wait(30)  # the rest of A's batch still being asked
        return found

    monkeypatch.setattr(FileStore, "version", version)
    sample = damacy.Sample(uri, np.s_[0:4, 0:12, 0:10])
    a = Planner(md, fresh_after=time.monotonic())
    thread = threading.Thread(name="A", target=lambda: a.plan([sample], (4, 12, 10)))
    thread.start()
    assert asked.wait(30)
    create(uri, 2, shape=(8, 24, 20))
    b = Planner(md, fresh_after=time.monotonic())
    go.set()
    thread.join(30)
    assert b.plan([sample], (4, 12, 10)).metas[0].shape == (8, 24, 20)


def test_a_load_that_lands_after_a_sessions_check_is_checked_before_use(tmp_path):
    """A read that began before the array was re-created lands after a session opened later
    checked (and found nothing cached): the session checks the entry before using it."""
    uri = str(tmp_path / "a.zarr")
    create(uri, 1)
    md = Resolver()
    store, root = md.store_of(uri)
    began = time.monotonic()
    stale = md._load(store, root, uri, docs := [])  # another session's read, in flight
    create(uri, 2, shape=(8, 24, 20))
    since = time.monotonic()  # this session opens
    md.recheck([(uri, None)], since)  # nothing cached yet
    md._keep(root, stale, Seen(store, tuple(docs), began))  # the other read lands
    assert md.arrays([(uri, None)], since)[(uri, None)].shape == (8, 24, 20)


def test_one_objects_failed_head_leaves_the_others_versions_asked(tmp_path):
    """A HEAD that fails for one object (403, 500) is that object's: the next object of the
    store is still asked (else an array re-created meanwhile would be taken as unchanged for
    minutes); a server that does not take HEAD (501) is not asked again for a while."""
    from damacy_server.store import resolve_uri
    from damacy_server.store.remote import NO_HEAD_S

    from object_servers import RangeServer

    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(b"x" * 10)
    server = RangeServer(tmp_path)
    try:
        store, root = resolve_uri(f"{server.url}/a")
        key = lambda name: store.join(root.rsplit("/", 1)[0], name)  # noqa: E731
        for status in (403, 500):
            server.fail["/b"] = [status] * 10
            with pytest.raises(damacy.StorageError, match=f"HTTP {status}"):
                store.version(key("b"))
            assert store.version(key("a"))[-1] == 10  # asked, and answered
        server.fail["/c"] = [501] * 10
        with pytest.raises(damacy.StorageError, match="HTTP 501"):
            store.version(key("c"))
        asked = len(server.requests)
        with pytest.raises(damacy.StorageError, match="refused a HEAD"):
            store.version(key("a"))
        assert len(server.requests) == asked and NO_HEAD_S > 60  # not asked
    finally:
        server.stop()
