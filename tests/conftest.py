"""Shared test helpers: arrays written by zarr-python, the independent oracle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
]


def random_data(shape, dtype, seed=0) -> np.ndarray:
    """Values that exercise the whole range of ``dtype`` (NaN and infinities for floats)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    data = (rng.standard_normal(shape) * 1000).astype(dtype)
    flat = data.reshape(-1)
    if flat.size >= 8:
        flat[[1, 3, 5]] = [np.nan, np.inf, -np.inf]
    return data


def write_array(
    path: Path | str,
    data: np.ndarray,
    *,
    chunks,
    shards=None,
    filters=(),
    serializer=None,
    compressors=(),
    fill_value=None,
    chunk_key_encoding=None,
    write=True,
) -> zarr.Array:
    """Write ``data`` with zarr-python and return the zarr array (the oracle)."""
    kwargs = {}
    if chunk_key_encoding is not None:
        kwargs["chunk_key_encoding"] = chunk_key_encoding
    arr = zarr.create_array(
        str(path),
        shape=data.shape,
        dtype=data.dtype,
        chunks=chunks,
        shards=shards,
        filters=list(filters),
        serializer=serializer or BytesCodec(endian="little"),
        compressors=list(compressors),
        fill_value=fill_value if fill_value is not None else np.zeros((), data.dtype)[()],
        **kwargs,
    )
    if write:
        arr[...] = data
    return arr


def edit_metadata(path: Path | str, **changes) -> dict:
    """Rewrite fields of an array's zarr.json (for metadata forms zarr-python does not write)."""
    meta_path = Path(path) / "zarr.json"
    doc = json.loads(meta_path.read_text())
    doc.update(changes)
    meta_path.write_text(json.dumps(doc))
    return doc


def assert_same(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert got.dtype == expected.dtype.newbyteorder("="), (got.dtype, expected.dtype)
    if got.dtype.kind == "f":
        np.testing.assert_array_equal(got, expected)  # NaN == NaN here
    else:
        assert np.array_equal(got, expected)


def padded_selection(full: np.ndarray, selection, fill=0, margin: int = 64) -> np.ndarray:
    """What damacy's selection rule says ``selection`` of ``full`` is, computed by numpy on
    ``full`` padded by ``margin`` fill values on every side: numbers are array coordinates
    (a negative one is before the array), positions outside read as ``fill``, entries
    select per axis (outer product), an integer drops its axis. Independent of damacy's
    own parsing; a test oracle."""
    entries = selection if isinstance(selection, tuple) else (selection,)
    named = sum(1 for e in entries if e is not Ellipsis)
    if any(e is Ellipsis for e in entries):
        i = next(k for k, e in enumerate(entries) if e is Ellipsis)
        entries = entries[:i] + (slice(None),) * (full.ndim - named) + entries[i + 1 :]
    entries = entries + (slice(None),) * (full.ndim - len(entries))
    out = np.pad(full, margin, constant_values=fill)
    for axis in reversed(range(full.ndim)):
        e, n = entries[axis], full.shape[axis]
        if type(e) is tuple:  # a range; index lists are lists (or damacy's Indices)
            e = slice(*e)
        if isinstance(e, slice):
            start = 0 if e.start is None else e.start
            stop = n if e.stop is None else e.stop
            out = out[(slice(None),) * axis + (slice(start + margin, stop + margin, e.step),)]
        else:
            out = np.take(out, np.asarray(e, dtype=np.int64) + margin, axis=axis)
    return out


@pytest.fixture(autouse=True)
def _hermetic_pipelines(request, monkeypatch):
    """damacy.Pipeline(cfg) uses a damacyd running at the node's default endpoint: a user's own
    daemon must not take the tests' pipelines (only tests marked node_daemon look for one)."""
    if request.node.get_closest_marker("node_daemon") is None:
        from damacy import pipeline

        monkeypatch.setattr(pipeline, "_node_daemon", lambda: None)
        monkeypatch.delenv("DAMACY_ENDPOINT", raising=False)


@pytest.fixture(scope="session")
def conformance_dir() -> Path:
    import os

    root = Path(os.environ.get("DAMACY_CONFORMANCE", Path(__file__).resolve().parents[2] / "shared" / "conformance"))
    if not (root / "EXPECTED.json").is_file():
        pytest.skip(f"conformance corpus not found at {root} (set DAMACY_CONFORMANCE to its folder)")
    return root


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    """A damacyd serving everything the tests write (the session's temporary folder)."""
    from daemon_helpers import DaemonProcess

    proc = DaemonProcess(tmp_path_factory.mktemp("damacyd"), [tmp_path_factory.getbasetemp()])
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()


@pytest.fixture(params=["embedded", "daemon", "cuda-host"])
def make(request):
    """Build a pipeline from a Config in each mode: in this process, by damacyd, or in this
    process with the CUDA executor on the host stand-in device (``DAMACY_DEVICE_STANDIN``:
    host memory, the kernels' host twin; the Config's device 0, its host budget the GPU's)."""
    import dataclasses

    import damacy

    if request.param == "embedded":
        return lambda cfg: damacy.Pipeline(cfg)
    if request.param == "cuda-host":
        from damacy_runtime.devices import STANDIN_ENV
        from damacy_server.cuda import twin

        if not twin.available():
            pytest.skip("the kernels' host twin was not built (no C compiler)")
        request.getfixturevalue("monkeypatch").setenv(STANDIN_ENV, "1")
        return lambda cfg: damacy.Pipeline(dataclasses.replace(cfg, device=0, max_gpu_memory_bytes=cfg.max_memory_bytes))
    endpoint = request.getfixturevalue("daemon").endpoint
    return lambda cfg: damacy.Pipeline(cfg, endpoint=endpoint)


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run only when asked for (``-m slow``): CI keeps its time."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
