"""The seed system's guides run as their documents write them.

Like ``test_seed.py`` for the seed README, these tests take the fenced ```python blocks of
the upstream guides (``../shared/seeds/upstream/*.md``) at test time and run them verbatim,
only their ``/data/...`` paths replaced by arrays and OME-Zarr images written here by
zarr-python, with the shapes and dtypes the code implies. A block that continues an earlier
one (a fragment) runs in that block's scope, as a reader would run it. The CUDA blocks run on
GPU 0 or, without one, on damacy's host stand-in device. Every batch the code hands to a
DLPack consumer is compared, sample by sample, with zarr-python's read of it
(``np.from_dlpack``/``torch.from_dlpack`` are wrapped; the code itself is not touched).

Blocks that are not Python (C, shell, text, mermaid) are listed and skipped; a Python block
that needs what this machine lacks (a CUDA build of torch, NCCL, a launcher) runs as far as
it can and skips with that reason. ``test_every_guide_block_is_accounted_for`` fails when a
guide gains a Python block no test here runs.

Tracebacks of the documents' code name the guide's file and line.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zarr
from test_seed import SEEDS, _fill_boxes, _needs_a_device, _volumes, with_paths
from zarr.codecs import ZstdCodec

import damacy

from pipeline_helpers import out_dtype

UPSTREAM = SEEDS / "upstream"
GUIDES = ("pipeline.md", "spatial.md", "index.md", "README-upstream.md", "dtypes.md", "distributed.md", "prefetch.md")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")


# -- the guides' code blocks -----------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A fenced code block: its guide, the heading it sits under, its place among the blocks
    of its language under that heading (``n``), its language and code, and the line of the
    guide its code starts on (1-based)."""

    doc: str
    heading: str
    n: int
    lang: str
    code: str
    line: int

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.doc, self.heading, self.n)

    @property
    def path(self) -> Path:
        return UPSTREAM / self.doc


def _blocks_of(doc: str) -> list[Block]:
    lines = (UPSTREAM / doc).read_text().splitlines()
    out: list[Block] = []
    counts: dict[tuple[str, str], int] = {}
    heading = ""
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            title = HEADING.match(lines[i])
            if title:
                heading = title.group(1)
            i += 1
            continue
        indent, lang = fence.group(1), fence.group(2) or "text"
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```" and lines[j].startswith(indent)), None)
        assert end is not None, f"{doc} line {i + 1}: a code block that is never closed"
        n = counts.get((heading, lang), 0)
        counts[(heading, lang)] = n + 1
        code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        out.append(Block(doc, heading, n, lang, code, i + 2))
        i = end + 1
    return out


def guide_blocks(doc: str) -> list[Block]:
    if not (UPSTREAM / doc).is_file():
        pytest.skip(f"the upstream guide is not at {UPSTREAM / doc} (a clone without ../shared/ beside it; set DAMACY_SEEDS)")
    return _blocks_of(doc)


def block(doc: str, heading: str, n: int = 0) -> Block:
    """The ``n``-th Python block under ``heading`` of ``doc``."""
    for b in guide_blocks(doc):
        if b.lang == "python" and b.heading == heading and b.n == n:
            return b
    raise AssertionError(f"{doc} has no Python block {n} under {heading!r} (the guide changed: update this test)")


def statements(b: Block, code: str | None = None) -> list[ast.stmt]:
    """The top-level statements of a block (``code``: the block with its paths replaced;
    the lines are the same), numbered by the guide's lines."""
    tree = ast.parse(code if code is not None else b.code, str(b.path))
    ast.increment_lineno(tree, b.line - 1)
    return tree.body


def execute(b: Block, scope: dict, stmts: list[ast.stmt] | ast.stmt) -> None:
    """Run statements of ``b`` in ``scope``, as the guide writes them."""
    body = [stmts] if isinstance(stmts, ast.stmt) else list(stmts)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(b.path), "exec"), scope)


def run(b: Block, scope: dict, paths: dict[str, str] | None = None, after=None) -> dict:
    """Run the whole of ``b`` (``/data`` paths replaced by ``paths``) in ``scope``, statement
    by statement; ``after(statement, scope)`` runs after each (the test prepares data or
    shortens a loop count there; the code is as written)."""
    code = with_paths(b.code, paths or {})
    for statement in statements(b, code):
        execute(b, scope, statement)
        if after is not None:
            after(statement, scope)
    return scope


def source(statement: ast.stmt) -> str:
    return ast.unparse(statement)


def assigns(statement: ast.stmt, name: str) -> bool:
    return isinstance(statement, ast.Assign) and any(getattr(t, "id", None) == name for t in statement.targets)


#: the Python blocks of the guides, and the tests here that run them
RUN_BY = {
    ("pipeline.md", "Construct a CPU pipeline", 0): ["test_pipeline_cpu_composition"],
    ("pipeline.md", "Select CUDA execution", 0): ["test_pipeline_cuda_executor_swap"],
    ("pipeline.md", "Indexed queries", 0): ["test_pipeline_indexed_query"],
    ("spatial.md", "Assemble the stages", 0): ["test_spatial_aligned_crop"],
    ("index.md", "CUDA quick start", 0): ["test_index_cuda_quick_start"],
    ("README-upstream.md", "CPU quick start", 0): ["test_readme_cpu_quick_start_and_indexed_query"],
    ("README-upstream.md", "Indexed queries", 0): ["test_readme_cpu_quick_start_and_indexed_query"],
    ("README-upstream.md", "CUDA quick start", 0): ["test_readme_cuda_quick_start_and_streaming"],
    ("README-upstream.md", "Streaming", 0): ["test_readme_cuda_quick_start_and_streaming"],
    ("dtypes.md", "Output types", 0): ["test_dtypes_uint16_output_cpu", "test_dtypes_uint16_output_cuda"],
    ("distributed.md", "Binding each rank to its GPU", 0): ["test_distributed_binding_lines"],
    ("distributed.md", "A complete torchrun example", 0): [
        "test_distributed_torchrun_example_one_rank", "test_distributed_torchrun_example_launched",
    ],
    ("prefetch.md", "Async prefetch", 0): ["test_prefetch_synchronous_pattern"],
    ("prefetch.md", "Deferred release (preferred)", 0): ["test_prefetch_deferred_release"],
    ("prefetch.md", "Dedicated copy stream", 0): ["test_prefetch_dedicated_copy_stream"],
}


def _all_blocks() -> list:
    if not UPSTREAM.is_dir():
        return [pytest.param(None, id="no-upstream-guides")]
    return [pytest.param(b, id=f"{b.doc}:{b.line}:{b.lang}") for doc in GUIDES if (UPSTREAM / doc).is_file() for b in _blocks_of(doc)]


@pytest.mark.parametrize("b", _all_blocks())
def test_every_guide_block_is_accounted_for(b):
    """Each Python block of the guides is run by a test here; the others are not Python."""
    if b is None:
        pytest.skip(f"the upstream guides are not at {UPSTREAM} (a clone without ../shared/ beside it; set DAMACY_SEEDS)")
    if b.lang != "python":
        pytest.skip(f"{b.doc} line {b.line} ({b.heading!r}): a ```{b.lang} block, not Python")
    assert b.key in RUN_BY, f"{b.doc} line {b.line}: a Python block under {b.heading!r} that no test here runs"
    for name in RUN_BY[b.key]:
        assert callable(globals().get(name)), name


# -- data written by zarr-python ---------------------------------------------------------------


def write_array(path: Path, data: np.ndarray, chunks, *, shards=None, dimension_names=None) -> zarr.Array:
    arr = zarr.create_array(
        str(path), shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards, fill_value=0,
        compressors=[ZstdCodec(level=1)], dimension_names=dimension_names,
    )
    arr[...] = data
    return arr


def ngff_image(path: Path, shape, seed: int, chunks=(32, 128, 128)) -> tuple[str, zarr.Array]:
    """An OME-Zarr 0.5 image (a zarr v3 group, ``attributes["ome"]`` multiscales) of two
    levels, "0" and "1" (2x in y and x), with ``dimension_names`` z, y, x; returns level 0's
    uri and array."""
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    axes = [{"name": a, "type": "space", "unit": "micrometer"} for a in "zyx"]
    datasets = [{"path": str(k), "coordinateTransformations": [{"type": "scale", "scale": [1.0, 2.0**k, 2.0**k]}]} for k in (0, 1)]
    group.attrs["ome"] = {"version": "0.5", "multiscales": [{"name": path.stem, "axes": axes, "datasets": datasets}]}
    level0 = np.random.default_rng(seed).integers(0, 60000, size=shape, dtype=np.uint16)
    arr = write_array(path / "0", level0, chunks, shards=tuple(2 * c for c in chunks), dimension_names=("z", "y", "x"))
    write_array(path / "1", level0[:, ::2, ::2], chunks, dimension_names=("z", "y", "x"))
    return str(path / "0"), arr


def images(tmp_path: Path, names, shape, chunks=(32, 128, 128)) -> tuple[dict[str, str], dict[str, zarr.Array]]:
    """``/data/<name>`` paths (of level-0 arrays, ".../0") -> images written under tmp_path."""
    paths, arrays = {}, {}
    for k, name in enumerate(names):
        uri, arr = ngff_image(tmp_path / name.removeprefix("/data/").removesuffix("/0"), shape, seed=k + 1, chunks=chunks)
        paths[name] = uri if name.endswith("/0") else str(Path(uri).parent)
        arrays[paths[name]] = arr
    return paths, arrays


def volumes(tmp_path: Path, names, shape, chunks=(32, 128, 128)) -> tuple[dict[str, str], dict[str, zarr.Array]]:
    """``/data/<name>`` paths -> plain uint16 arrays written under tmp_path."""
    paths, arrays = {}, {}
    for k, name in enumerate(names):
        path = tmp_path / name.removeprefix("/data/")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = np.random.default_rng(100 + k).integers(0, 60000, size=shape, dtype=np.uint16)
        paths[name] = str(path)
        arrays[str(path)] = write_array(path, data, chunks)
    return paths, arrays


# -- the oracle --------------------------------------------------------------------------------


def torch_numpy(t):
    """A torch tensor's values as numpy (bfloat16 through its bits)."""
    import torch

    t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(out_dtype("bf16"))
    return t.numpy()


class Oracle:
    """Wraps a DLPack consumer (``np.from_dlpack``, ``torch.from_dlpack``): each batch it is
    given is compared, sample by sample, with zarr-python's read of that sample (a box, an
    index query's outer product, or, for other queries, ``expect(query)``)."""

    def __init__(self, consume, to_numpy, arrays: dict[str, zarr.Array], expect=None) -> None:
        self.consume, self.to_numpy, self.arrays, self.expect = consume, to_numpy, arrays, expect
        self.batches = 0
        self.samples: list = []
        self.infos: list = []

    def want(self, sample) -> np.ndarray:
        if isinstance(sample, damacy.IndexQuery):
            selection = tuple(s if isinstance(s, slice) else np.asarray(list(s), dtype=np.int64) for s in sample.selection)
            return self.arrays[sample.uri].oindex[selection]
        if isinstance(sample, damacy.Sample):
            return self.arrays[sample.uri][tuple(slice(a, b) for a, b in sample.aabb)]
        assert self.expect is not None, f"no expectation for {sample!r}"
        return self.expect(sample)

    def __call__(self, batch, *args, **kwargs):
        out = self.consume(batch, *args, **kwargs)
        info = batch.info
        got = self.to_numpy(out)
        assert got.shape == info.shape and not info.errors and not info.skipped, (got.shape, info)
        dtype = out_dtype(str(info.dtype))
        assert got.dtype == dtype, (got.dtype, info.dtype)
        for j, sample in enumerate(info.samples):
            want = self.want(sample)
            assert want.shape == got.shape[1:], (want.shape, got.shape, sample)
            want = want.astype(dtype)  # u16 -> f32/bf16/u16: exact, or rounded once
            bits = f"u{dtype.itemsize}"  # no NaN here: equal values are equal bits
            assert np.array_equal(got[j].view(bits), want.view(bits)), f"batch {info.batch_id} sample {j} ({sample}) differs from zarr-python's read"
        self.batches += 1
        self.samples.extend(info.samples)
        self.infos.append(info)
        return out


def _unwrapped(consume):
    """The consumer itself, not an oracle set earlier in the same test."""
    return consume.consume if isinstance(consume, Oracle) else consume


def numpy_oracle(monkeypatch, arrays, expect=None) -> Oracle:
    oracle = Oracle(_unwrapped(np.from_dlpack), np.asarray, arrays, expect)
    monkeypatch.setattr(np, "from_dlpack", oracle)
    return oracle


def torch_oracle(monkeypatch, arrays, expect=None) -> Oracle:
    import torch

    oracle = Oracle(_unwrapped(torch.from_dlpack), torch_numpy, arrays, expect)
    monkeypatch.setattr(torch, "from_dlpack", oracle)
    return oracle


def cuda_torch_or_skip(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"{what} needs a CUDA build of torch and a GPU (torch {torch.__version__}: torch.cuda.is_available() is False)")


# -- pipeline.md -------------------------------------------------------------------------------

IMAGES = ["/data/image-1.zarr/0", "/data/image-2.zarr/0"]


def _pipeline_cpu(tmp_path, monkeypatch) -> tuple[Block, dict, Oracle, dict[str, str]]:
    """pipeline.md's first block, run: its scope, the oracle that saw its batch, its paths."""
    b = block("pipeline.md", "Construct a CPU pipeline")
    paths, arrays = images(tmp_path, IMAGES, (64, 256, 256))
    oracle = numpy_oracle(monkeypatch, arrays)
    scope = run(b, {}, paths)
    assert oracle.batches == 1 and [s.uri for s in oracle.samples] == [paths[n] for n in IMAGES]
    return b, scope, oracle, paths


def test_pipeline_cpu_composition(tmp_path, monkeypatch):
    """The CPU composition, verbatim (its own assertions: the shape, a CPU batch)."""
    _, scope, oracle, _ = _pipeline_cpu(tmp_path, monkeypatch)
    assert oracle.infos[0].device_type == damacy.DeviceType.CPU
    with pytest.raises(damacy.ShutdownError):
        scope["pipeline"].pop()  # closed by its `with`


def test_pipeline_cuda_executor_swap(tmp_path, monkeypatch):
    """"In a CUDA-enabled build, replace the executor with" the block, in the scope of the
    CPU block; "the remaining pipeline arguments and samples stay the same. Consume the
    result with torch.from_dlpack(batch)" (GPU 0, or the host stand-in)."""
    _, scope, _, paths = _pipeline_cpu(tmp_path, monkeypatch)
    _needs_a_device(monkeypatch)
    import torch

    swap = block("pipeline.md", "Select CUDA execution")
    run(swap, scope)
    executor = scope["executor"]
    assert isinstance(executor, damacy.CudaExecutor) and executor.device == 0
    arrays = {paths[n]: zarr.open_array(paths[n], mode="r") for n in IMAGES}
    oracle = torch_oracle(monkeypatch, arrays)
    with damacy.Pipeline(
        planner=scope["planner"], executor=executor, output=scope["output"], queues=scope["queues"]
    ) as pipeline:
        assert pipeline.device == 0
        pipeline.push([damacy.Sample(uri=paths[n], aabb=[(0, 64), (0, 256), (0, 256)]) for n in IMAGES])
        with pipeline.pop() as batch:
            x = torch.from_dlpack(batch)
            assert tuple(x.shape) == (2, 64, 256, 256) and x.dtype == torch.float32
            assert batch.info.device == "cuda:0"
            if torch.cuda.is_available():
                assert batch.info.device_type == damacy.DeviceType.CUDA
            del x
    assert oracle.batches == 1 and [s.uri for s in oracle.samples] == [paths[n] for n in IMAGES]


def test_pipeline_indexed_query(tmp_path, monkeypatch):
    """The indexed query, in the scope of the CPU block (its planner and CPU executor:
    ``np.from_dlpack(batch)  # CPU executor``), against zarr-python's ``oindex``."""
    _, scope, _, _ = _pipeline_cpu(tmp_path, monkeypatch)
    b = block("pipeline.md", "Indexed queries")
    paths, arrays = images(tmp_path / "q", ["/data/image.zarr/0"], (16, 128, 128))
    oracle = numpy_oracle(monkeypatch, arrays)
    run(b, scope, paths)
    query = scope["query"]
    assert isinstance(query, damacy.IndexQuery) and query.shape == (3, 64, 4)
    assert oracle.batches == 1 and oracle.samples == [query]
    assert oracle.infos[0].shape == (1, 3, 64, 4) and oracle.infos[0].device_type == damacy.DeviceType.CPU
    want = arrays[paths["/data/image.zarr/0"]].oindex[[7, 2, 7], 16:80, [100, 3, 40, 3]]
    assert np.array_equal(oracle.want(query), want)


# -- spatial.md --------------------------------------------------------------------------------


def test_spatial_aligned_crop(tmp_path, monkeypatch):
    """NgffImage + SpatialQuery resolved to an aligned crop of level 0, pushed to a CPU
    pipeline: the batch is zarr-python's read of that crop."""
    b = block("spatial.md", "Assemble the stages")
    uri, level0 = ngff_image(tmp_path / "image.zarr", (32, 128, 128), seed=7, chunks=(16, 64, 64))
    group = str(Path(uri).parent)

    def crop(query) -> np.ndarray:
        # the document's transform: identity linear part, an integral offset into level 0
        matrix = np.asarray(scope["query"].output_to_reference, dtype=float)
        assert np.array_equal(matrix[:, :3], np.eye(3)), matrix
        begin = [int(v) for v in matrix[:, 3]]
        return level0[tuple(slice(a, a + n) for a, n in zip(begin, scope["output"].shape))]

    scope: dict = {}
    oracle = numpy_oracle(monkeypatch, {uri: level0}, expect=crop)
    run(b, scope, {"/data/image.zarr": group})
    resolved = scope["resolved"]
    assert isinstance(resolved, damacy.ResolvedSpatialQuery)
    assert resolved.level == 0 and not resolved.requires_resampling and resolved.uri.rstrip("/").endswith("/0")
    assert resolved.shape == (16, 64, 64) and resolved.source_bounds_index == ((8, 24), (16, 80), (16, 80))
    levels = scope["image"].levels
    assert [Path(lvl.uri) for lvl in levels] == [Path(group) / "0", Path(group) / "1"]
    assert [tuple(lvl.shape) for lvl in levels] == [(32, 128, 128), (32, 64, 64)]
    assert [tuple(lvl.scale_to_reference) for lvl in levels] == [(1, 1, 1), (1, 2, 2)]
    # "A scale-only 2x level instead has origin_l = -0.5"
    assert [tuple(lvl.origin_reference_index) for lvl in levels] == [(0, 0, 0), (0, -0.5, -0.5)]
    assert oracle.batches == 1 and len(oracle.samples) == 1
    got = oracle.want(oracle.samples[0])
    assert np.array_equal(got, level0[8:24, 16:80, 16:80])


# -- index.md ----------------------------------------------------------------------------------


def _index_quick_start_paths(tmp_path):
    return volumes(tmp_path, ["/data/cells/cell-1.zarr", "/data/cells/cell-2.zarr"], (64, 256, 256))


def test_index_cuda_quick_start(tmp_path, monkeypatch):
    """index.md's CUDA quick start, verbatim (GPU 0, or the host stand-in): one batch of the
    two cells, in bf16, equal to zarr-python's reads rounded once."""
    b = block("index.md", "CUDA quick start")
    _needs_a_device(monkeypatch)
    paths, arrays = _index_quick_start_paths(tmp_path)
    oracle = torch_oracle(monkeypatch, arrays)
    scope = run(b, {}, paths)
    assert oracle.batches == 1 and [s.uri for s in oracle.samples] == list(paths.values())
    assert scope["x"].shape == (2, 64, 256, 256) and str(oracle.infos[0].dtype) == "bf16"
    assert oracle.infos[0].device == "cuda:0"


# -- README-upstream.md ------------------------------------------------------------------------


def test_readme_cpu_quick_start_and_indexed_query(tmp_path, monkeypatch, capsys):
    """The CPU quick start verbatim (it prints the batch's shape), then the indexed query in
    its scope, pushed as the README says: "Choose BatchSpec with that sample shape and pass
    the query to pipeline.push" (with the quick start's planner and executor)."""
    quick = block("README-upstream.md", "CPU quick start")
    paths, arrays = images(tmp_path, IMAGES, (64, 256, 256))
    oracle = numpy_oracle(monkeypatch, arrays)
    scope = run(quick, {}, paths)
    assert capsys.readouterr().out.strip() == "(2, 64, 256, 256)"
    assert oracle.batches == 1 and [s.uri for s in oracle.samples] == [paths[n] for n in IMAGES]

    indexed = block("README-upstream.md", "Indexed queries")
    qpaths, qarrays = images(tmp_path / "q", ["/data/image.zarr/0"], (16, 128, 128))
    oracle.arrays.update(qarrays)
    run(indexed, scope, qpaths)
    query = scope["query"]
    with damacy.Pipeline(
        planner=scope["planner"], executor=scope["executor"],
        output=damacy.BatchSpec(samples=1, shape=query.shape, dtype="u16"),
        queues=damacy.QueueLimits(lookahead_samples=2),
    ) as pipeline:
        pipeline.push([query])
        with pipeline.pop() as batch:
            got = np.from_dlpack(batch)[0].copy()
    assert oracle.batches == 2 and oracle.samples[-1] == query
    assert np.array_equal(got, qarrays[qpaths["/data/image.zarr/0"]].oindex[[7, 2, 7], 16:80, [100, 3, 40, 3]])


def test_readme_cuda_quick_start_and_streaming(tmp_path, monkeypatch):
    """The CUDA quick start verbatim (GPU 0, or the host stand-in), on the README's three
    volumes at their full shapes (metadata, and data in the last batch's boxes), then the
    streaming example in its scope, with N_STEPS (the reader's) = 2."""
    quick = block("README-upstream.md", "CUDA quick start")
    streaming = block("README-upstream.md", "Streaming")
    _needs_a_device(monkeypatch)
    paths, arrays = _volumes(tmp_path)
    oracle = torch_oracle(monkeypatch, arrays)
    random.seed(2026)

    def after(statement, scope):
        if assigns(statement, "samples"):
            _fill_boxes(scope["samples"], arrays, last=8)  # the last batch: real data, not only fill

    scope = run(quick, {}, paths, after)
    assert oracle.batches == 8 and len(oracle.samples) == 64
    assert all(isinstance(s, damacy.Sample) and s.shape == (64, 256, 256) for s in scope["samples"])
    assert oracle.samples == scope["samples"]  # in push order
    assert all(str(i.dtype) == "bf16" and i.shape == (8, 64, 256, 256) for i in oracle.infos)

    scope["N_STEPS"] = 2
    run(streaming, scope)
    assert oracle.batches == 10
    assert all(s.uri in arrays and s.shape == (64, 256, 256) for s in oracle.samples[64:])


# -- dtypes.md ---------------------------------------------------------------------------------


def _uint16_output(tmp_path, monkeypatch) -> tuple[Block, dict, dict[str, str]]:
    """pipeline.md's CPU composition, then dtypes.md's ``output`` line in its scope."""
    first, scope, _, paths = _pipeline_cpu(tmp_path, monkeypatch)
    run(block("dtypes.md", "Output types"), scope)
    output = scope["output"]
    assert output.dtype == damacy.Dtype.U16 and str(output.dtype) == "u16"
    assert output.samples == 2 and tuple(output.shape) == (64, 256, 256)
    return first, scope, paths


def test_dtypes_uint16_output_cpu(tmp_path, monkeypatch):
    """``BatchSpec(..., dtype="uint16")`` in place of the CPU composition's output, and that
    block's pipeline statement run again as written: a uint16 batch, bit-equal to
    zarr-python's uint16 reads."""
    first, scope, paths = _uint16_output(tmp_path, monkeypatch)
    arrays = {paths[n]: zarr.open_array(paths[n], mode="r") for n in IMAGES}
    oracle = numpy_oracle(monkeypatch, arrays)
    pipeline_statement = [s for s in statements(first, with_paths(first.code, paths)) if isinstance(s, ast.With)]
    assert len(pipeline_statement) == 1, "pipeline.md's CPU block has one `with damacy.Pipeline(...)` statement"
    execute(first, scope, pipeline_statement)
    assert oracle.batches == 1 and oracle.infos[0].dtype == damacy.Dtype.U16


def test_dtypes_uint16_output_cuda(tmp_path, monkeypatch):
    """The same ``output`` with pipeline.md's CUDA executor (GPU 0, or the host stand-in),
    consumed with ``torch.from_dlpack``: uint16, bit-equal to zarr-python's reads."""
    _, scope, paths = _uint16_output(tmp_path, monkeypatch)
    _needs_a_device(monkeypatch)
    import torch

    run(block("pipeline.md", "Select CUDA execution"), scope)
    arrays = {paths[n]: zarr.open_array(paths[n], mode="r") for n in IMAGES}
    oracle = torch_oracle(monkeypatch, arrays)
    with damacy.Pipeline(
        planner=scope["planner"], executor=scope["executor"], output=scope["output"], queues=scope["queues"]
    ) as pipeline:
        pipeline.push([damacy.Sample(uri=paths[n], aabb=[(0, 64), (0, 256), (0, 256)]) for n in IMAGES])
        with pipeline.pop() as batch:
            x = torch.from_dlpack(batch)
            assert x.dtype == torch.uint16 and tuple(x.shape) == (2, 64, 256, 256)
            del x
    assert oracle.batches == 1 and oracle.infos[0].dtype == damacy.Dtype.U16


# -- distributed.md ----------------------------------------------------------------------------


def _torchrun_main(b: Block) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """The torchrun example's module statements, and its ``main()``'s body."""
    module = statements(b)
    mains = [s for s in module if isinstance(s, ast.FunctionDef) and s.name == "main"]
    assert len(mains) == 1, "distributed.md's torchrun example defines main()"
    return module, mains[0].body


def test_distributed_binding_lines(monkeypatch):
    """The two binding lines elide Config's other arguments (``Config(..., device=...)``), so
    they do not run as written; both run, with the arguments, in the torchrun example (see
    test_distributed_torchrun_example_*): this checks they are the example's lines."""
    lines = block("distributed.md", "Binding each rank to its GPU")
    example = block("distributed.md", "A complete torchrun example")
    two = statements(lines)
    assert [source(s) for s in two] == ["torch.cuda.set_device(local_rank)", "cfg = damacy.Config(..., device=local_rank)"]
    _, body = _torchrun_main(example)
    assert "torch.cuda.set_device(local_rank)" in [source(s) for s in body]
    config = [s for s in body if assigns(s, "cfg")]
    assert len(config) == 1
    call = config[0].value
    assert isinstance(call, ast.Call) and source(call.func) == "damacy.Config"
    assert [source(k.value) for k in call.keywords if k.arg == "device"] == ["local_rank"]


def _crops_for_rank(arrays: dict[str, zarr.Array]):
    """The reader's ``crops_for_rank`` (the guide leaves its body to the reader: "Sharding
    policy lives here"): a fixed list of crops, strided across ranks, repeated forever."""
    uris = sorted(arrays)
    all_samples = [
        damacy.Sample(uri=uris[k % len(uris)], aabb=[(z, z + 64), (y, y + 256), (x, x + 256)])
        for k, (z, y, x) in enumerate([(0, 0, 0), (16, 64, 32), (32, 0, 64), (8, 32, 0), (24, 64, 64), (0, 16, 48)] * 2)
    ]

    def crops_for_rank(rank: int, world_size: int):
        mine = all_samples[rank::world_size]
        while True:
            yield from mine

    return crops_for_rank, all_samples


def _run_torchrun_example(tmp_path, monkeypatch, *, launched: bool) -> None:
    """main()'s statements in order, as one rank of ``torchrun --standalone`` runs them
    (LOCAL_RANK=0, RANK=0, WORLD_SIZE=1), with the reader's crops_for_rank and n_steps = 3.
    ``launched``: every statement as written (NCCL and a CUDA torch). Otherwise the process
    group is a single-rank gloo one the test starts in the place of ``init_process_group(
    backend="nccl")``, and ``torch.cuda.set_device`` (CUDA torch only) is left out; the rest,
    the Config and the pipeline included, runs as written."""
    b = block("distributed.md", "A complete torchrun example")
    _needs_a_device(monkeypatch)
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip(f"torch {torch.__version__} has no torch.distributed")
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():
        monkeypatch.setenv(name, value)
    paths, arrays = volumes(tmp_path, ["/data/a.zarr", "/data/b.zarr"], (96, 320, 320))
    oracle = torch_oracle(monkeypatch, arrays)
    module, body = _torchrun_main(b)
    scope: dict = {"__name__": "train"}  # imported, not launched: `if __name__ == "__main__"` does not call main()
    execute(b, scope, module)
    assert scope["crops_for_rank"](0, 1) is None  # the guide's is a stub for the reader's policy
    scope["crops_for_rank"], all_samples = _crops_for_rank(arrays)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for statement in body:
                text = source(statement)
                if not launched and text == "dist.init_process_group(backend='nccl')":
                    dist.init_process_group(backend="gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
                    continue
                if not launched and text == "torch.cuda.set_device(local_rank)":
                    continue
                execute(b, scope, statement)
                if assigns(statement, "n_steps"):
                    assert scope["n_steps"] == 10_000
                    scope["n_steps"] = 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not [w for w in caught if "LOCAL_RANK" in str(w.message)], [str(w.message) for w in caught]
    assert scope["local_rank"] == 0 and scope["world_size"] == 1
    cfg = scope["cfg"]
    assert (cfg.samples_per_batch, tuple(cfg.sample_shape), cfg.max_gpu_memory_bytes) == (8, (64, 256, 256), 1 << 30)
    assert (cfg.dtype, cfg.n_io_threads, cfg.metadata_io_concurrency, cfg.device) == (damacy.Dtype.BF16, 4, 32, 0)
    assert oracle.batches == 3 and oracle.samples == (all_samples * 2)[:24]
    assert all(i.shape == (8, 64, 256, 256) and i.device == "cuda:0" for i in oracle.infos)


def test_distributed_torchrun_example_one_rank(tmp_path, monkeypatch):
    """The torchrun example's main() on one rank, here: a gloo group of one in place of
    NCCL's, no torch.cuda.set_device (a CPU torch has none); its Config and pipeline as
    written (GPU 0, or the host stand-in)."""
    _run_torchrun_example(tmp_path, monkeypatch, launched=False)


def test_distributed_torchrun_example_launched(tmp_path, monkeypatch):
    """The torchrun example's main() with every statement as written (NCCL, set_device)."""
    import torch
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        pytest.skip(
            "distributed.md's torchrun example as written needs NCCL and a CUDA build of torch "
            f"(torch {torch.__version__}: cuda available={torch.cuda.is_available()}, "
            f"nccl available={dist.is_available() and dist.is_nccl_available()}); "
            "test_distributed_torchrun_example_one_rank runs the rest of it"
        )
    _run_torchrun_example(tmp_path, monkeypatch, launched=True)


# -- prefetch.md -------------------------------------------------------------------------------


def _quick_start_scope(tmp_path, monkeypatch) -> tuple[Block, dict, list[ast.stmt], Oracle]:
    """index.md's CUDA quick start, the statements before its pipeline (``cfg``, ``samples``)
    run; the pipeline statement returned; the oracle wrapping torch.from_dlpack."""
    quick = block("index.md", "CUDA quick start")
    _needs_a_device(monkeypatch)
    paths, arrays = _index_quick_start_paths(tmp_path)
    oracle = torch_oracle(monkeypatch, arrays)
    stmts = statements(quick, with_paths(quick.code, paths))
    head = [s for s in stmts if not isinstance(s, ast.With)]
    scope: dict = {}
    execute(quick, scope, head)
    return quick, scope, stmts, oracle


def test_prefetch_synchronous_pattern(tmp_path, monkeypatch):
    """``with batch as t: x = torch.from_dlpack(t)`` on a batch of the quick start's pipeline
    (GPU 0, or the host stand-in): the batch is released at the block's end, ``x`` keeps its
    buffer (it still holds the batch's values)."""
    b = block("prefetch.md", "Async prefetch")
    _, scope, _, oracle = _quick_start_scope(tmp_path, monkeypatch)
    with damacy.Pipeline(scope["cfg"]) as d:
        d.push(scope["samples"])
        scope["batch"] = d.pop()
        run(b, scope)
        assert oracle.batches == 1
        with pytest.raises(BufferError):
            _ = scope["batch"].info  # released by the `with` block
        x = torch_numpy(scope["x"])
        for j, sample in enumerate(oracle.samples):
            assert np.array_equal(x[j].view("u2"), oracle.want(sample).astype(x.dtype).view("u2")), j
        del x
        scope.pop("x")


def test_prefetch_deferred_release(tmp_path, monkeypatch):
    """The deferred-release pattern: its ``prefetch(p)`` in a background thread (the
    reader's ``prefetch_future``), on the quick start's pipeline (GPU 0, or the host
    stand-in); then ``batch.release(event=torch.cuda.current_stream())``, which needs a
    CUDA build of torch (skipped, saying so, without one, after the rest has run)."""
    b = block("prefetch.md", "Deferred release (preferred)")
    _, scope, _, oracle = _quick_start_scope(tmp_path, monkeypatch)
    import torch

    stmts = statements(b)
    assert isinstance(stmts[0], ast.FunctionDef) and stmts[0].name == "prefetch"
    execute(b, scope, stmts[0])
    no_cuda = None
    with damacy.Pipeline(scope["cfg"]) as d, ThreadPoolExecutor(1) as pool:
        d.push(scope["samples"])
        scope["prefetch_future"] = pool.submit(scope["prefetch"], d)
        for statement in stmts[1:]:
            text = source(statement)
            if "torch.cuda" in text and not torch.cuda.is_available():
                no_cuda = text
                scope["batch"].release()  # what the loop must do anyway before the pipeline closes
                continue
            execute(b, scope, statement)
            if assigns(statement, "tensor") or (isinstance(statement, ast.Assign) and "prefetch_future" in text):
                assert oracle.batches == 1 and tuple(scope["tensor"].shape) == (2, 64, 256, 256)
        assert "tensor" not in scope  # `del tensor`
        with pytest.raises(BufferError):
            _ = scope["batch"].info  # released
    assert oracle.batches == 1 and len(oracle.samples) == 2
    if no_cuda is not None:
        pytest.skip(
            f"prefetch.md's deferred release ran on the stand-in up to `{no_cuda}`, which needs a CUDA build "
            f"of torch (torch {torch.__version__}: torch.cuda.is_available() is False); the batch was released plainly"
        )


def test_prefetch_dedicated_copy_stream(tmp_path, monkeypatch):
    """The dedicated-copy-stream pattern (``torch.cuda.Stream()`` first): CUDA torch only.
    Where it runs, its ``prefetch(p)`` returns a copy equal to zarr-python's reads."""
    b = block("prefetch.md", "Dedicated copy stream")
    cuda_torch_or_skip("prefetch.md's dedicated-copy-stream pattern (torch.cuda.Stream)")
    _, scope, _, oracle = _quick_start_scope(tmp_path, monkeypatch)
    run(b, scope)
    with damacy.Pipeline(scope["cfg"]) as d:
        d.push(scope["samples"])
        tensor = scope["prefetch"](d)
        got = torch_numpy(tensor)
        assert oracle.batches == 1
        for j, sample in enumerate(oracle.samples):
            assert np.array_equal(got[j].view("u2"), oracle.want(sample).astype(got.dtype).view("u2")), j
