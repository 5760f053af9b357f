"""damacy.ray: samples read by damacy's engine in Ray Data read tasks on a local Ray cluster
(two worker CPUs), every row traced to its sample and compared with zarr-python."""

from __future__ import annotations

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy

from conftest import random_data, write_array

ray = pytest.importorskip("ray")
damacy_ray = pytest.importorskip("damacy.ray")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    """A sharded zstd volume, a second array of another shape and labels beside the volume."""
    root = tmp_path_factory.mktemp("ray")
    vol = random_data((40, 48, 36), "uint16", seed=3)
    other = random_data((20, 33, 30), "uint16", seed=4)
    labels = (vol % 5).astype("uint8")
    write_array(root / "vol.zarr", vol, chunks=(8, 12, 9), shards=(16, 24, 18), compressors=[ZstdCodec()])
    write_array(root / "other.zarr", other, chunks=(10, 11, 10))
    write_array(root / "labels.zarr", labels, chunks=(20, 24, 18))
    return {str(root / "vol.zarr"): vol, str(root / "other.zarr"): other, str(root / "labels.zarr"): labels}


def _rows(ds) -> dict[str, np.ndarray]:
    blocks = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}


def test_grid_windows_every_window_once_exact(cluster, arrays):
    vol, other = list(arrays)[:2]
    windows = damacy.GridBoxes([vol, other], (10, 16, 16), step=(10, 16, 12))
    n = len(windows)
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(10, 16, 16), dtype="f32", n_io_threads=1, decode_workers=1, drop_last=False)
    source = damacy_ray.Datasource(windows, cfg, rows_per_task=8, embedded=True)
    assert source.uris == (vol, other)
    tasks = source.get_read_tasks(64)
    assert (
        len(tasks) == -(-n // 8) and sum(t.metadata.num_rows for t in tasks) == n
    )  # whole batches, every window in one task
    rows = _rows(ray.data.read_datasource(source))
    assert sorted(rows["index"].tolist()) == list(range(n))  # every window read once
    want = list(windows)
    for i, x, a, o, f in zip(rows["index"], rows["data"], rows["array"], rows["origin"], rows["filled"]):
        s = want[i]
        assert source.uris[a] == s.uri and tuple(o) == tuple(e.start for e in s.selection) and not f
        z, y, xx = o
        np.testing.assert_array_equal(x, arrays[s.uri][z : z + 10, y : y + 16, xx : xx + 16].astype("f4"))
    # the columns iter_torch_batches and map_batches hand a model
    ds = damacy_ray.read(windows, cfg, rows_per_task=8, embedded=True)
    batch = next(iter(ds.iter_torch_batches(batch_size=6)))
    assert tuple(batch["data"].shape) == (6, 10, 16, 16) and str(batch["data"].dtype) == "torch.float32"
    assert tuple(batch["origin"].shape) == (6, 3) and str(batch["index"].dtype) == "torch.int64"
    sums = _rows(ds.map_batches(lambda b: {"index": b["index"], "sum": b["data"].sum(axis=(1, 2, 3))}))
    by_index = dict(zip(sums["index"].tolist(), sums["sum"].tolist()))
    assert len(by_index) == n
    for i in (0, n // 2, n - 1):
        s = want[i]
        np.testing.assert_allclose(by_index[i], damacy.read(s.uri, s.selection, dtype="f32").sum(), rtol=1e-5)


def test_a_sampler_computes_its_positions_in_the_tasks(cluster, arrays):
    vol, other = list(arrays)[:2]
    boxes = damacy.RandomBoxes([vol, other], (8, 12, 12), samples_per_epoch=40, seed=7)
    boxes.set_epoch(3)
    cfg = damacy.Config(samples_per_batch=5, sample_shape=(8, 12, 12), dtype="u16", n_io_threads=1, decode_workers=1, drop_last=False)
    rows = _rows(damacy_ray.read(boxes, cfg, rows_per_task=10, embedded=True))
    want = list(boxes)  # epoch 3's boxes: the tasks computed these from their positions
    assert sorted(rows["index"].tolist()) == list(range(40))
    for i, x in zip(rows["index"], rows["data"]):
        s = want[i]
        np.testing.assert_array_equal(x, arrays[s.uri][s.selection])
    # datasets are read when consumed: each keeps the epoch its sampler had when it was made
    early = damacy_ray.read(boxes, cfg, rows_per_task=10, embedded=True)  # epoch 3
    boxes.set_epoch(4)
    late = _rows(damacy_ray.read(boxes, cfg, rows_per_task=10, embedded=True))
    rows = _rows(early)
    epoch4 = list(boxes)
    assert epoch4 != want
    for got, samples in ((rows, want), (late, epoch4)):
        for i, x in zip(got["index"], got["data"]):
            np.testing.assert_array_equal(x, arrays[samples[i].uri][samples[i].selection])
    # a shuffled list: its order of this epoch, an index query among the boxes
    items = [damacy.Sample(vol, np.s_[z : z + 8, 0:12, 0:12]) for z in range(0, 32, 4)] + [
        damacy.IndexQuery(other, ([0, 5] * 4, [1, 2] * 6, np.s_[0:12]))
    ]
    shuffled = damacy.Shuffled(items, seed=2)
    shuffled.set_epoch(1)
    source = damacy_ray.Datasource(shuffled, cfg, rows_per_task=5, embedded=True)
    assert source.uris == (vol, other) and source._boxes is None
    rows = _rows(ray.data.read_datasource(source))
    want = list(shuffled)
    assert sorted(rows["index"].tolist()) == list(range(len(items))) and want != items
    for i, x in zip(rows["index"], rows["data"]):
        np.testing.assert_array_equal(x, damacy.read(want[i].uri, want[i].selection, dtype="u16"))


def test_lists_index_queries_multi_samples_and_a_daemon(cluster, arrays, daemon):
    vol, other, labels = arrays
    cfg = damacy.Config(samples_per_batch=3, sample_shape=(3, 20, 20), dtype="i32", n_io_threads=1, decode_workers=1, drop_last=False)
    small = [damacy.Sample(vol, np.s_[z : z + 3, 0:20, 4:24]) for z in range(0, 30, 3)]
    small.insert(4, damacy.IndexQuery(other, ([3, 1, 1], np.s_[0:20], list(range(0, 30, 3)) * 2)))
    source = damacy_ray.Datasource(small, cfg, rows_per_task=3, endpoint=daemon.endpoint)  # through damacyd
    assert source.uris == (vol, other) and source._boxes is None  # an index query: no origin column
    rows = _rows(ray.data.read_datasource(source))
    assert "origin" not in rows and sorted(rows["index"].tolist()) == list(range(len(small)))
    for i, x in zip(rows["index"], rows["data"]):
        s = small[i]
        if isinstance(s, damacy.IndexQuery):
            want = arrays[other][[3, 1, 1]][:, 0:20][:, :, list(range(0, 30, 3)) * 2]
        else:
            want = arrays[vol][s.selection]
        np.testing.assert_array_equal(x, want.astype("i4"))
    # image and labels at one box, a column each
    multi = [
        damacy.MultiSample.at({"image": vol, "labels": labels}, np.s_[z : z + 4, 8:24, 0:16]) for z in range(0, 36, 4)
    ]
    configs = {
        "image": damacy.Config(
            samples_per_batch=2, sample_shape=(4, 16, 16), dtype="f32", n_io_threads=1, decode_workers=1, drop_last=False
        ),
        "labels": damacy.Config(
            samples_per_batch=2, sample_shape=(4, 16, 16), dtype="u8", n_io_threads=1, decode_workers=1, drop_last=False
        ),
    }
    rows = _rows(damacy_ray.read(multi, configs, rows_per_task=4, embedded=True))
    assert sorted(rows["index"].tolist()) == list(range(len(multi)))
    for i, img, lab, o in zip(rows["index"], rows["image"], rows["labels"], rows["origin"]):
        z = 4 * i
        assert tuple(o) == (z, 8, 0)
        np.testing.assert_array_equal(img, arrays[vol][z : z + 4, 8:24, 0:16].astype("f4"))
        np.testing.assert_array_equal(lab, arrays[labels][z : z + 4, 8:24, 0:16])


def test_a_bad_sample_is_filled_or_named(cluster, arrays, tmp_path):
    vol = list(arrays)[0]
    missing = str(tmp_path / "missing.zarr")
    samples = [damacy.Sample(vol, np.s_[z : z + 4, 0:8, 0:8]) for z in range(0, 24, 4)]
    samples[3] = damacy.Sample(missing, np.s_[0:4, 0:8, 0:8])
    fill = damacy.Config(
        samples_per_batch=2, sample_shape=(4, 8, 8), dtype="u16", on_error="fill", n_io_threads=1, decode_workers=1, drop_last=False
    )
    rows = _rows(damacy_ray.read(samples, fill, embedded=True))
    assert sorted(rows["index"].tolist()) == list(range(6))
    for i, x, f, a in zip(rows["index"], rows["data"], rows["filled"], rows["array"]):
        assert bool(f) == (i == 3) and a == (i == 3)  # uris: (vol, missing), in the order first seen
        if i != 3:
            np.testing.assert_array_equal(x, arrays[vol][samples[i].selection])
        else:
            assert (x == 0).all()
    skip = damacy.Config(
        samples_per_batch=2, sample_shape=(4, 8, 8), dtype="u16", on_error="skip", n_io_threads=1, decode_workers=1, drop_last=False
    )
    rows = _rows(damacy_ray.read(samples, skip, embedded=True))
    assert sorted(rows["index"].tolist()) == [0, 1, 2, 4, 5]  # the rest, each where it belongs
    for i, x in zip(rows["index"], rows["data"]):
        np.testing.assert_array_equal(x, arrays[vol][samples[i].selection])
    # a group whose second part is missing: the row is marked filled (its first part read)
    group = [damacy.MultiSample.at({"image": vol, "labels": vol}, np.s_[z : z + 4, 0:8, 0:8]) for z in range(0, 16, 4)]
    group[1] = damacy.MultiSample(dict(group[1].parts, labels=damacy.Sample(missing, np.s_[0:4, 0:8, 0:8])))
    configs = {name: fill for name in ("image", "labels")}
    rows = _rows(damacy_ray.read(group, configs, rows_per_task=4, embedded=True))
    assert sorted(rows["index"].tolist()) == [0, 1, 2, 3]
    assert [bool(f) for _, f in sorted(zip(rows["index"].tolist(), rows["filled"]))] == [False, True, False, False]
    strict = damacy.Config(samples_per_batch=2, sample_shape=(4, 8, 8), dtype="u16", n_io_threads=1, decode_workers=1, drop_last=False)
    with pytest.raises(Exception, match="missing.zarr"):  # Ray's error carries damacy's: the sample and its cause
        damacy_ray.read(samples, strict, embedded=True, max_retries=0).take_all()


def test_what_a_datasource_refuses(arrays):
    vol = list(arrays)[0]
    s = damacy.Sample(vol, np.s_[0:4, 0:8, 0:8])
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 8, 8), drop_last=False)
    for bad, match in [
        ((s, damacy.Config(samples_per_batch=2, sample_shape=(4, 8, 8), dtype="bf16", drop_last=False)), "bf16"),
        ((s, damacy.Config(samples_per_batch=2, sample_shape=(4, 8, 8), device=0, drop_last=False)), "host memory"),
        ((s, damacy.Config(samples_per_batch=2, sample_shape=(4, 8, 8), drop_last=True)), "drop_last"),
        ((s, damacy.Config(samples_per_batch=2, sample_shape=(4, 8, 8))), "drop_last=False"),  # the default
        ((s, {"image": cfg}), "MultiSamples"),
        ((s, "f32"), "damacy.Config"),
    ]:
        with pytest.raises(damacy.InvalidArgument, match=match):
            damacy_ray.Datasource([bad[0]], bad[1])
    with pytest.raises(damacy.InvalidArgument, match="iterable of samples"):
        damacy_ray.Datasource(s, cfg)
    with pytest.raises(damacy.InvalidArgument, match="sample 1 is a str"):
        damacy_ray.Datasource([s, vol], cfg)
    with pytest.raises(damacy.InvalidArgument, match="clash"):
        damacy_ray.Datasource([], {"index": cfg})
    assert damacy_ray.Datasource([], cfg).get_read_tasks(4) == []


def test_the_readme_and_guide_blocks_run(cluster, arrays, tmp_path):
    from test_readme import block

    volume = tmp_path / "volume.zarr"
    data = random_data((64, 256, 256), "uint16", seed=5)
    write_array(volume, data, chunks=(32, 128, 128), compressors=[ZstdCodec()])
    code = block("ray")
    assert '"s3://bucket/volume.zarr"' in code
    scope: dict = {}
    exec(compile(code.replace("s3://bucket/volume.zarr", str(volume)), "README ray", "exec"), scope)
    assert tuple(scope["x"].shape) == (1, 64, 256, 256) and scope["where"].tolist() == [[0, 0, 0]]
    np.testing.assert_array_equal(scope["x"][0].numpy(), data.astype("f4"))
    vol, _, labels = list(arrays)  # (two arrays the block's boxes fit in: it reads with out_of_bounds="error")
    code = block("raydata")
    assert '"data/a.zarr", "data/b.zarr"' in code
    exec(compile(code.replace("data/a.zarr", vol).replace("data/b.zarr", labels), "the guide's Ray Data block", "exec"), {})
