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
from damacy_server.plan.planner import ChunkPlanner
from damacy_server.plan.resolve import ZarrMetadata

from daemon_helpers import DaemonProcess

SHAPE = (16, 24, 20)


def create(path, seed: int, *, fmt: int = 3, shape=SHAPE) -> np.ndarray:
    """(Re-)create the array at ``path`` with zarr-python, as a script that writes a dataset
    again does: same path, same layout (sharded in v3), other values."""
    data = np.random.default_rng(seed).integers(0, 60000, size=shape, dtype="uint16")
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
    md = ZarrMetadata()
    md.array(uri)  # cached by an earlier run
    sample = damacy.Sample(uri, np.s_[0:4, 0:12, 0:10])
    planner = ChunkPlanner(md, fresh_after=time.monotonic())
    for _ in range(3):
        plan = planner.plan([sample, sample], (4, 12, 10))
        assert not plan.errors
    assert (md.rechecked, md.changed) == (1, 0)  # once, for both samples and all batches
    md.locate(md.array(uri), np.array([[0, 0, 0]]))  # a shard index cached
    assert len(md.cache.shard_indexes) == 1
    create(uri, 2, shape=(12, 24, 20))
    ChunkPlanner(md).plan([sample], (4, 12, 10))  # no recheck: the cached metadata as it is
    assert md.array(uri).shape == SHAPE and md.changed == 0
    plan = ChunkPlanner(md, fresh_after=time.monotonic()).plan([sample], (4, 12, 10))
    assert not plan.errors and md.changed == 1 and md.array(uri).shape == (12, 24, 20)
    assert len(md.cache.shard_indexes) == 1  # the old index went; the new plan's is there
    # a store that cannot tell versions keeps what it cached (taken to be unchanged)
    md.array(uri)
    md._seen.peek(md.store_of(uri)[1]).version = None
    create(uri, 3, shape=(4, 24, 20))
    ChunkPlanner(md, fresh_after=time.monotonic()).plan([sample], (4, 12, 10))
    assert md.changed == 1 and md.array(uri).shape == (12, 24, 20)


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
