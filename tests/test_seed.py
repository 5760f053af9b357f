"""The seed's public API is a contract: its quick starts run as the seed writes them.

``test_seed_*`` take the code of the seed document (``../shared/seeds/``, beside a clone) at
test time and run it verbatim, only its ``/data/...`` paths replaced by arrays written here
by zarr-python, with the shapes the code expects; they skip, saying why, where the seed is
not there. ``test_the_seed_spellings_*`` use every spelling those quick starts use, written
here, so a clone alone still guards them. Values are checked against zarr-python as the
code hands batches over (``np.from_dlpack``/``torch.from_dlpack`` are wrapped to compare what
they return; the code itself is not touched).
"""

from __future__ import annotations

import ast
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, ShardingCodec, ZstdCodec

import damacy
from damacy_runtime.devices import STANDIN_ENV, cuda_devices

from pipeline_helpers import expected_box, out_dtype, same

SEEDS = Path(os.environ.get("DAMACY_SEEDS", Path(__file__).resolve().parents[2] / "shared" / "seeds"))
SEED = SEEDS / "000_25899fea03a8d15c.txt"
#: the seed's section headings, in order (each code block ends before the next heading)
HEADINGS = ["CPU quick start", "Indexed queries", "CUDA quick start", "Streaming", "Zarr support"]
LE = BytesCodec(endian="little")


def seed_text() -> str:
    if not SEED.is_file():
        pytest.skip(f"the seed document is not at {SEED} (a clone without ../shared/ beside it; set DAMACY_SEEDS to its folder)")
    return SEED.read_text()


def code_of(text: str, heading: str) -> str:
    """The code block of a section: from the first line where one starts, the longest run of
    lines that Python compiles (the prose around it does not), before the next heading."""
    lines = text.splitlines()
    first = lines.index(heading) + 1
    stop = min((lines.index(h, first) for h in HEADINGS if h in lines[first:]), default=len(lines))
    for start in range(first, stop):
        if not lines[start].strip():
            continue
        found = None
        for end in range(start + 1, stop + 1):
            code = "\n".join(lines[start:end]).rstrip() + "\n"
            try:
                compile(code, heading, "exec")
            except SyntaxError:
                continue
            found = code
        if found is not None and "damacy" in found:
            return found
    raise AssertionError(f"the seed's {heading!r} section has no code block")


def with_paths(code: str, paths: dict[str, str]) -> str:
    """``code`` with its ``"/data/..."`` literals replaced; every one must be in ``paths``."""
    named = set(re.findall(r'"(/data/[^"]*)"', code))
    assert named == set(paths), f"the seed's code names {sorted(named)}, the test writes {sorted(paths)}"
    return re.sub(r'"(/data/[^"]*)"', lambda m: repr(paths[m.group(1)]), code)


def run_statements(code: str, name: str, scope: dict, after=None) -> None:
    """Run ``code``'s top-level statements in order in ``scope``; ``after(statement, scope)``
    runs after each (the test prepares data between them; the code is as written)."""
    tree = ast.parse(code)
    for statement in tree.body:
        exec(compile(ast.Module(body=[statement], type_ignores=[]), name, "exec"), scope)
        if after is not None:
            after(statement, scope)


def write(path: Path, shape, *, data=None, codec="zstd", chunks=(32, 128, 128), shards=None) -> zarr.Array:
    """A uint16 array of ``shape`` (with ``data``, or only its metadata: unwritten chunks read
    as the fill value)."""
    kwargs = {}
    if codec == "zstd":
        kwargs["compressors"] = [ZstdCodec(level=1)]
    elif codec == "blosc":
        kwargs["compressors"] = [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle")]
    else:
        kwargs["compressors"] = None
    arr = zarr.create_array(str(path), shape=shape, dtype="uint16", chunks=chunks, shards=shards, fill_value=3, **kwargs)
    if data is not None:
        arr[...] = data
    return arr


def image(path: Path, shape, seed: int) -> tuple[str, zarr.Array]:
    """An OME-NGFF 0.5 image of two levels; returns level 0's uri and array."""
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    axes = [{"name": a, "type": "space", "unit": "micrometer"} for a in "zyx"]
    datasets = [{"path": str(k), "coordinateTransformations": [{"type": "scale", "scale": [1.0, 2.0**k, 2.0**k]}]} for k in (0, 1)]
    group.attrs["ome"] = {"version": "0.5", "multiscales": [{"name": path.stem, "axes": axes, "datasets": datasets}]}
    rng = np.random.default_rng(seed)
    level0 = rng.integers(0, 4000, size=shape, dtype=np.uint16)
    arr = write(path / "0", shape, data=level0, shards=(32, 256, 256))
    write(path / "1", (shape[0], shape[1] // 2, shape[2] // 2), data=level0[:, ::2, ::2])
    return str(path / "0"), arr


class Checked:
    """Wraps a DLPack consumer (``np.from_dlpack``, ``torch.from_dlpack``): each batch it is
    given is compared, sample by sample, with what zarr-python reads."""

    def __init__(self, consume, to_numpy, arrays: dict[str, zarr.Array]) -> None:
        self.consume, self.to_numpy, self.arrays = consume, to_numpy, arrays
        self.batches = 0
        self.samples = 0

    def __call__(self, batch, *args, **kwargs):
        out = self.consume(batch, *args, **kwargs)
        info = batch.info
        got = self.to_numpy(out)
        assert got.shape == info.shape and not info.errors, (got.shape, info)
        dtype = out_dtype(info.dtype)
        for j, sample in enumerate(info.samples):
            oracle = self.arrays[sample.uri]
            want = oracle[tuple(slice(a, b) for a, b in sample.aabb)].astype(dtype)  # u16 -> f32/bf16: exact, or rounded once
            bits = f"u{dtype.itemsize}"  # no NaN here: equal values are equal bits
            assert np.array_equal(got[j].view(bits), want.view(bits)), f"batch {info.batch_id} sample {j} ({sample}) differs from zarr-python's read"
        self.batches += 1
        self.samples += len(info.samples)
        return out


# -- the seed's code, verbatim -------------------------------------------------------------


def test_seed_cpu_quick_start_runs_verbatim(tmp_path, monkeypatch, capsys):
    code = code_of(seed_text(), "CPU quick start")
    uris = {}
    arrays = {}
    for k in (1, 2):
        uri, arr = image(tmp_path / f"image-{k}.zarr", (64, 256, 256), seed=k)
        uris[f"/data/image-{k}.zarr/0"] = uri
        arrays[uri] = arr
    checked = Checked(np.from_dlpack, np.asarray, arrays)
    monkeypatch.setattr(np, "from_dlpack", checked)
    exec(compile(with_paths(code, uris), "the seed's CPU quick start", "exec"), {})
    assert capsys.readouterr().out.strip() == "(2, 64, 256, 256)"
    assert checked.batches == 1 and checked.samples == 2


def test_seed_indexed_query_runs_verbatim(tmp_path):
    code = code_of(seed_text(), "Indexed queries")
    uri, arr = image(tmp_path / "image.zarr", (16, 128, 128), seed=3)
    scope: dict = {"damacy": damacy}
    exec(compile(with_paths(code, {"/data/image.zarr/0": uri}), "the seed's indexed query", "exec"), scope)
    query = scope["query"]
    # "Choose BatchSpec with that sample shape and pass the query to pipeline.push"
    with damacy.Pipeline(
        planner=damacy.ChunkPlanner(
            metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache())
        ),
        executor=damacy.CpuExecutor(reader=damacy.FileReader(), limits=damacy.CpuLimits(max_memory_bytes=64 << 20)),
        output=damacy.BatchSpec(samples=1, shape=query.shape, dtype="u16"),
        queues=damacy.QueueLimits(lookahead_samples=2),
    ) as pipeline:
        pipeline.push([query])
        with pipeline.pop() as batch:
            got = np.from_dlpack(batch)[0]
    assert np.array_equal(got, arr.oindex[[7, 2, 7], 16:80, [100, 3, 40, 3]])


def _needs_a_device(monkeypatch) -> None:
    """The CUDA quick start runs on GPU 0; without one, on the host stand-in device (host
    memory, the kernels' host twin: the same executor and code)."""
    pytest.importorskip("torch", reason="the seed's CUDA quick start uses torch (the test extra brings it)")
    from damacy_server.cuda import twin

    if cuda_devices()[0] == 0:
        if not twin.available():
            pytest.skip("no GPU here, and the kernels' host twin that stands in for one was not built (no C compiler)")
        monkeypatch.setenv(STANDIN_ENV, "1")


def _volumes(tmp_path) -> tuple[dict[str, str], dict[str, zarr.Array]]:
    """The seed's three volumes at their full shapes: metadata only, chunks written later."""
    # sharded (a shard never written is known missing from the planner on: filled, not read)
    specs = {
        "/data/cells/brain-001.zarr": ((512, 4096, 4096), dict(codec="zstd", chunks=(32, 128, 128), shards=(64, 512, 512))),
        "/data/cells/brain-002.zarr": ((768, 4096, 4096), dict(codec="blosc", chunks=(64, 128, 128), shards=(128, 512, 512))),
        "/data/cells/kidney-007.zarr": ((256, 2048, 2048), dict(codec="raw", chunks=(32, 128, 128), shards=(64, 256, 256))),
    }
    uris, arrays = {}, {}
    for name, (shape, kw) in specs.items():
        path = tmp_path / name.removeprefix("/data/")
        path.parent.mkdir(parents=True, exist_ok=True)
        uris[name] = str(path)
        arrays[str(path)] = write(path, shape, **kw)
    return uris, arrays


def _fill_boxes(samples, arrays, last: int) -> None:
    """Data for the boxes of the ``last`` samples (the rest of the volumes stays unwritten:
    the fill value), written by zarr-python."""
    rng = np.random.default_rng(0)
    for sample in samples[-last:]:
        box = tuple(slice(a, b) for a, b in sample.aabb)
        arrays[sample.uri][box] = rng.integers(0, 60000, size=tuple(b - a for a, b in sample.aabb), dtype=np.uint16)


def test_seed_cuda_quick_start_runs_verbatim(tmp_path, monkeypatch):
    text = seed_text()
    _needs_a_device(monkeypatch)
    import torch

    code = code_of(text, "CUDA quick start")
    uris, arrays = _volumes(tmp_path)
    checked = Checked(torch.from_dlpack, lambda t: t.cpu().view(torch.int16).numpy().view(out_dtype("bf16")), arrays)
    monkeypatch.setattr(torch, "from_dlpack", checked)
    random.seed(2026)

    def after(statement, scope):
        if isinstance(statement, ast.Assign) and any(getattr(t, "id", None) == "samples" for t in statement.targets):
            _fill_boxes(scope["samples"], arrays, last=8)  # the last batch: real data, not only fill

    scope: dict = {}
    run_statements(with_paths(code, uris), "the seed's CUDA quick start", scope, after)
    assert checked.batches == 8 and checked.samples == 64
    assert all(isinstance(s, damacy.Sample) and s.shape == (64, 256, 256) for s in scope["samples"])

    # "Streaming": the same config, an endless generator of the quick start's crops
    streaming = code_of(text, "Streaming")
    scope["N_STEPS"] = 2
    exec(compile(with_paths(streaming, {}), "the seed's streaming example", "exec"), scope)
    assert checked.batches == 10


# -- the same spellings, written here ----------------------------------------------------


@pytest.fixture
def volume(tmp_path):
    rng = np.random.default_rng(5)
    data = rng.integers(0, 60000, size=(24, 40, 48), dtype=np.uint16)
    sharded = ShardingCodec(chunk_shape=(8, 8, 16), codecs=[LE, ZstdCodec(level=1)], index_codecs=[LE])
    arr = zarr.create_array(str(tmp_path / "v.zarr"), shape=data.shape, dtype="uint16", chunks=(16, 16, 48), serializer=sharded, compressors=None)
    arr[...] = data
    return str(tmp_path / "v.zarr"), arr


def test_the_seed_spellings_composed_style(volume, monkeypatch):
    """Every spelling of the seed's CPU quick start and indexed query, on a small array."""
    uri, arr = volume
    metadata_reader = damacy.FileMetadataReader(concurrency=64)
    chunk_reader = damacy.FileReader(workers=8, max_inflight_reads=4096)
    metadata = damacy.ZarrMetadata(
        reader=metadata_reader,
        cache=damacy.MetadataCache(array_entries=256, shard_index_entries=8192),
    )
    planner = damacy.ChunkPlanner(metadata=metadata, limits=damacy.PlanLimits())
    executor = damacy.CpuExecutor(
        reader=chunk_reader,
        limits=damacy.CpuLimits(max_memory_bytes=3 << 30, decode_workers=8),
    )
    assert metadata_reader.concurrency == 64 and metadata.reader is metadata_reader
    with damacy.Pipeline(
        planner=planner,
        executor=executor,
        output=damacy.BatchSpec(samples=2, shape=(8, 16, 16), dtype="f32"),
        queues=damacy.QueueLimits(lookahead_samples=4, prepared_batches=2),
        out_of_bounds="pad",  # damacy's own: the second sample reaches before the array
    ) as pipeline:
        pipeline.push([
            damacy.Sample(uri=uri, aabb=[(0, 8), (0, 16), (0, 16)]),
            damacy.Sample(uri=uri, aabb=((16, 24), (-4, 12), slice(40, 56))),  # a tuple, a slice; padded
            damacy.Sample(uri, [(0, 8), (0, 16), (0, 16)]),  # DESIGN's Sample(uri, aabb): the box in the selection's place
            damacy.Sample(uri, ((8, 16), slice(0, 16), (16, 32))),
        ])
        for first in (0, 2):
            with pipeline.pop() as batch:
                array = np.from_dlpack(batch)
                assert array.shape == (2, 8, 16, 16)
                assert np.array_equal(array[0], arr[0:8, 0:16, 0:16].astype("f4"))
                if first == 0:
                    assert same(array[1], expected_box(arr, [(16, 24), (-4, 12), (40, 56)], np.dtype("f4")))
                else:
                    assert np.array_equal(array[1], arr[8:16, 0:16, 16:32].astype("f4"))
                del array
    with pytest.raises(TypeError, match="aabb axis 0: expected slice or"):
        damacy.Sample(uri, [0, 8])  # a list is the seed's aabb: per axis a pair or a slice, never an int
    with pytest.raises(TypeError, match="aabb axis 2: expected slice or .* got list"):
        damacy.Sample(uri, [(8, 16), slice(0, 16), [16, 32]])  # nor a list
    query = damacy.IndexQuery(uri=uri, selection=([7, 2, 7], slice(16, 40), [10, 3, 40, 3]))
    assert query.shape == (3, 24, 4)
    assert np.array_equal(damacy.read(uri, query.selection), arr.oindex[[7, 2, 7], 16:40, [10, 3, 40, 3]])


def test_the_seed_spellings_config_style(volume, monkeypatch):
    """Every spelling of the seed's CUDA quick start and streaming example (GPU 0, or the
    host stand-in), on a small array."""
    _needs_a_device(monkeypatch)
    import torch
    uri, arr = volume
    cfg = damacy.Config(
        samples_per_batch=2,
        sample_shape=(8, 16, 16),
        max_gpu_memory_bytes=1 << 26,
        dtype="bf16",
        device=0,
    )
    samples = [damacy.Sample(uri=uri, aabb=[(z, z + 8), (4, 20), (30, 46)]) for z in range(0, 16, 2)]
    seen = 0
    with damacy.Pipeline(cfg) as p:
        p.push(samples)
        for batch in p.batches(len(samples) // cfg.samples_per_batch):
            with batch as t:
                x = torch.from_dlpack(t)
                got = x.cpu().view(torch.int16).numpy().view(out_dtype("bf16"))
                for j, sample in enumerate(batch.info.samples):
                    assert same(got[j], expected_box(arr, sample.aabb, out_dtype("bf16")))
                    seen += 1
    assert seen == len(samples)

    def crops():
        while True:
            yield damacy.Sample(uri=uri, aabb=[(0, 8), (0, 16), (0, 16)])

    with damacy.Pipeline(cfg) as p:
        p.push(crops())
        for _ in range(3):
            with p.pop() as t:
                x = torch.from_dlpack(t)
                assert np.array_equal(x.float().numpy()[1], arr[0:8, 0:16, 0:16].astype("f4").astype(out_dtype("bf16")).astype("f4"))
