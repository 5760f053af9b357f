"""Random boxes and index selections (hypothesis) against zarr-python, element for element."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec, TransposeCodec, ZstdCodec

import damacy

from conftest import assert_same, padded_selection, random_data, write_array

SHAPE = (23, 31, 17)
LE = BytesCodec(endian="little")

LAYOUTS = {
    "chunked-zstd": dict(chunks=(5, 7, 4), compressors=[ZstdCodec(level=1)]),
    "chunked-transpose-blosc": dict(
        chunks=(6, 8, 5), filters=[TransposeCodec(order=(1, 2, 0))], compressors=[BloscCodec(cname="lz4", shuffle="bitshuffle", typesize=4)]
    ),
    "sharded-start": dict(
        chunks=(10, 16, 8),
        serializer=ShardingCodec(chunk_shape=(5, 4, 4), codecs=[LE, GzipCodec(level=1)], index_codecs=[LE, Crc32cCodec()], index_location="start"),
    ),
    "sharded-nested": dict(
        chunks=(12, 16, 8),
        serializer=ShardingCodec(
            chunk_shape=(6, 8, 8),
            codecs=[ShardingCodec(chunk_shape=(3, 4, 2), codecs=[LE, ZstdCodec(level=1)])],
            index_codecs=[LE, Crc32cCodec()],
        ),
    ),
}


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    root = tmp_path_factory.mktemp("random")
    out = {}
    for i, (name, kwargs) in enumerate(LAYOUTS.items()):
        data = random_data(SHAPE, "float32", seed=i)
        oracle = write_array(root / name, data, **kwargs)
        out[name] = (str(root / name), oracle)
    return out


@st.composite
def boxes(draw):
    box = []
    for n in SHAPE:
        start = draw(st.integers(0, n))
        stop = draw(st.integers(start, n))
        box.append((start, stop))
    return tuple(box)


@st.composite
def index_selections(draw):
    sel = []
    for n in SHAPE:
        kind = draw(st.sampled_from(["list", "slice", "step"]))
        if kind == "list":
            sel.append(draw(st.lists(st.integers(-n, n - 1), min_size=0, max_size=12)))
        elif kind == "slice":
            start = draw(st.integers(0, n))
            sel.append(slice(start, draw(st.integers(start, n))))
        else:
            sel.append(slice(draw(st.integers(0, n - 1)), None, draw(st.integers(2, 5))))
    return tuple(sel)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(box=boxes())
def test_random_boxes(arrays, layout, box):
    uri, oracle = arrays[layout]
    assert_same(damacy.read(uri, box), oracle[tuple(slice(a, b) for a, b in box)])


_WHOLE: dict[str, np.ndarray] = {}  # zarr-python's read of each array, by uri


@pytest.mark.parametrize("layout", ["chunked-zstd", "sharded-nested"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sel=index_selections())
def test_random_index_selections(arrays, layout, sel):
    uri, oracle = arrays[layout]
    # numpy's orthogonal indexing of zarr-python's array padded with its fill value
    # (negative indices are before the array); zarr-python reads the whole array once
    whole = _WHOLE.get(uri)
    if whole is None:
        whole = _WHOLE[uri] = oracle[...]
    expected = padded_selection(whole, sel, oracle.fill_value)
    assert_same(damacy.read(uri, sel, out_of_bounds="pad"), expected)
    if all(isinstance(s, slice) or min(s, default=0) >= 0 for s in sel):
        assert_same(damacy.read(uri, sel), expected)
    else:
        with pytest.raises(damacy.OutOfBounds, match="not counted from the end"):
            damacy.read(uri, sel)
