"""The CUDA kernels, checked without a GPU: the host twin (the same source compiled as C)
against the numpy reference of the numeric contract and against the CPU paths, bit for
bit; the kernels compiled by nvcc when it is installed."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec, BytesCodec, ShardingCodec, ZstdCodec

import damacy
from damacy_server.cuda import tables, twin
from damacy_server.decode import contract
from damacy_server.decode.contract import edge_values
from damacy_server.plan.planner import Planner
from damacy_server.plan.resolve import Resolver
from damacy_server.zarr.codecs.blosc import unshuffle_block

from conftest import random_data, write_array

pytestmark = pytest.mark.skipif(not twin.available(), reason="the kernels' host twin was not built (no C compiler)")

KERNELS = Path(__file__).resolve().parents[1] / "damacy_server" / "cuda" / "kernels"
BF16 = np.dtype(ml_dtypes.bfloat16)
SOURCES = [np.dtype(t) for t in ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"]]
OUTPUTS = SOURCES + [BF16]


def bits(a: np.ndarray) -> np.ndarray:
    """An array's bytes per element, to compare NaNs and signed zeros exactly."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape + (a.dtype.itemsize,)) if a.ndim else a.view(np.uint8)


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(bits(got), bits(want))


# -- the numeric contract -------------------------------------------------------------


@pytest.mark.parametrize("src", SOURCES, ids=str)
@pytest.mark.parametrize("order", ["<", ">"])
def test_twin_conversions_are_the_contract_on_edge_values(src, order):
    values = edge_values(src).astype(src.newbyteorder(order))
    for dst in OUTPUTS:
        got = twin.convert(values, dst)
        want = contract.convert(values, dst)
        assert same_bits(got, want), (src, dst, values[~np.all(bits(got) == bits(want), axis=-1)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src=st.sampled_from(SOURCES), raw=st.binary(min_size=64, max_size=64), order=st.sampled_from("<>"))
def test_twin_conversions_are_the_contract_on_any_bits(src, raw, order):
    values = np.frombuffer(raw[: 64 // src.itemsize * src.itemsize], dtype=src.newbyteorder(order))
    if src == np.bool_:
        values = values.astype(np.uint8).clip(0, 1).astype(bool)  # a bool is 0 or 1
    for dst in OUTPUTS:
        assert same_bits(twin.convert(values, dst), contract.convert(values, dst)), (src, dst)


def test_the_contract_is_numpys_where_numpy_defines_it():
    for src in SOURCES:
        values = edge_values(src)
        for dst in OUTPUTS:
            if contract.differs(src, dst):
                continue
            with np.errstate(invalid="ignore", over="ignore"):
                assert same_bits(contract.convert(values, dst), values.astype(dst)), (src, dst)


def test_float_to_integer_saturates():
    v = np.array([np.nan, np.inf, -np.inf, 1e300, -1e300, 2.0**63, -2.0**63, 2.0**64, 127.99, -128.99, -0.99, 0.99], dtype=np.float64)
    assert contract.convert(v, np.int8).tolist() == [0, 127, -128, 127, -128, 127, -128, 127, 127, -128, 0, 0]
    assert contract.convert(v, np.uint8).tolist() == [0, 255, 0, 255, 0, 255, 0, 255, 127, 0, 0, 0]
    i64 = contract.convert(v, np.int64).tolist()
    assert i64[:8] == [0, 2**63 - 1, -(2**63), 2**63 - 1, -(2**63), 2**63 - 1, -(2**63), 2**63 - 1]
    assert contract.convert(v, np.uint64).tolist()[:8] == [0, 2**64 - 1, 0, 2**64 - 1, 0, 2**63, 0, 2**64 - 1]


def _nearest_even(x: Fraction, finite: np.ndarray, values: list[Fraction], floats: np.ndarray) -> int:
    """Index into ``finite`` (sorted bit patterns) of the value nearest ``x``, ties to even
    (``floats``: ``values`` as floats, to find the neighbours)."""
    k = int(np.searchsorted(floats, float(x)))
    best = None
    for j in (k - 1, k, k + 1):
        if 0 <= j < len(values):
            d = abs(values[j] - x)
            key = (d, int(finite[j]) & 1)
            if best is None or key < best[0]:
                best = (key, j)
    return best[1]


INTEGERS = [np.dtype(t) for t in ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]]


@pytest.mark.parametrize("src", INTEGERS, ids=str)
def test_integer_to_integer_clamps(src):
    """Values in range are kept, the others clamp to the output's range (negatives to 0 for
    unsigned outputs): numpy's astype wraps instead."""
    values = edge_values(src)
    big = values.astype(src.newbyteorder(">"))
    for dst in INTEGERS:
        lo, hi = int(np.iinfo(dst).min), int(np.iinfo(dst).max)
        want = np.array([min(max(v, lo), hi) for v in values.tolist()], dtype=dst)
        for arr in (values, big):
            assert same_bits(contract.convert(arr, dst), want), (arr.dtype, dst)
            assert same_bits(twin.convert(arr, dst), want), (arr.dtype, dst)
    assert contract.convert(np.array([-1, 12, 256], dtype="int16"), np.uint8).tolist() == [0, 12, 255]
    assert twin.convert(np.array([-1, 12, 256], dtype="int16"), np.uint8).tolist() == [0, 12, 255]


def test_the_documented_float_example():
    v = np.array([-1.9, 12.9, np.nan, np.inf], dtype="float32")
    assert contract.convert(v, np.int16).tolist() == twin.convert(v, np.int16).tolist() == [-1, 12, 0, 32767]


@pytest.mark.parametrize("src", [np.dtype("int32"), np.dtype("uint32"), np.dtype("int64"), np.dtype("uint64")], ids=str)
def test_integers_to_bf16_round_through_f32(src):
    """Against exact arithmetic: the value rounded to f32 (nearest, ties to even), then that
    rounded to bf16 (the same): two roundings, which differ from one where f32's rounding
    lands on a bf16 midpoint (ml_dtypes' astype rounds once)."""
    rng = np.random.default_rng(2)
    hi = 62 if src.itemsize == 8 else 30
    draws = [int(rng.integers(2**24, 2**hi)) | 1 for _ in range(400)]
    # just above a bf16 midpoint, within half an f32 ulp of it: f32 makes a tie of it
    for e in range(24, hi):
        mid = 2**e + 2 ** (e - 8)
        draws += [mid + 1, mid + 2 ** (e - 24) // 2, 2**e + 3 * 2 ** (e - 8) + 1]
    arr = np.array(draws, dtype=src)
    if src.kind == "i":
        arr = np.concatenate([arr, -arr])
    got = contract.convert(arr, BF16).view(np.uint16)
    assert np.array_equal(got, twin.convert(arr, BF16).view(np.uint16))
    f32 = [_round_fraction(Fraction(x), 24) for x in arr.tolist()]
    want = np.array([float(_round_fraction(f, 8)) for f in f32], dtype=np.float32).astype(BF16).view(np.uint16)
    assert np.array_equal(got, want), arr[got != want]
    once = np.array([float(_round_fraction(Fraction(x), 8)) for x in arr.tolist()], dtype=np.float32).astype(BF16).view(np.uint16)
    assert (once != want).any()  # the values reach the cases where two roundings differ from one


def _round_fraction(x: Fraction, precision: int) -> Fraction:
    """A nonzero rational, far inside f32's exponent range, rounded to ``precision``
    significand bits, ties to even."""
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    ulp = Fraction(2) ** (e - precision + 1)
    k, rem = divmod(a / ulp, 1)
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and k % 2 == 1):
        k += 1
    return k * ulp if x > 0 else -k * ulp


def test_f64_to_bf16_is_rounded_once():
    """Against exact arithmetic: the nearest bf16, ties to even, for values between bf16's
    neighbours (where rounding through f32 would go wrong): f64 is damacy's own source type,
    rounded once."""
    patterns = np.arange(0, 0x7F80, dtype=np.uint16)  # non-negative finite bf16
    values = [Fraction(float(v)) for v in patterns.view(BF16).astype(np.float64)]
    rng = np.random.default_rng(1)
    lo = rng.integers(0x0080, 0x7F7F, size=400)
    xs = [values[i] + (values[i + 1] - values[i]) * Fraction(int(rng.integers(0, 2**20)), 2**20) for i in lo]
    xs += [(values[i] + values[i + 1]) / 2 for i in lo[:50]]  # exact midpoints: ties
    # just off a midpoint, closer than f32 can tell: rounding through f32 makes a tie of it
    xs += [(values[i] + values[i + 1]) / 2 + sign * (values[i + 1] - values[i]) / 2**20 for i in lo[50:150] for sign in (1, -1)]
    arr = np.array([float(x) for x in xs], dtype=np.float64)
    got = contract.convert(arr, BF16).view(np.uint16)
    assert np.array_equal(got, twin.convert(arr, BF16).view(np.uint16))
    floats = np.array([float(v) for v in values])
    for x, g in zip(arr.tolist(), got.tolist()):
        want = patterns[_nearest_even(Fraction(x), patterns, values, floats)]
        assert g == want, (x, hex(g), hex(want))


def test_kernel_bodies_do_not_branch_on_the_compiler():
    """Only device.h may tell nvcc from gcc, or the twin would not be the kernel."""
    for path in KERNELS.iterdir():
        if path.name != "device.h":
            assert "__CUDACC__" not in path.read_text(), path.name


# -- assembly ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    root = tmp_path_factory.mktemp("twin")
    out = {}
    for name, dtype, endian, extra in [
        ("u16-zstd", "uint16", "little", {"compressors": [ZstdCodec(level=1)]}),
        ("f32-big", "float32", "big", {}),
        ("i8-sharded", "int8", "little", {"serializer": ShardingCodec(chunk_shape=(3, 4, 5), codecs=[BytesCodec(), ZstdCodec(level=1)])}),
        ("f64", "float64", "little", {}),
    ]:
        data = random_data((12, 16, 20), dtype, seed=len(out))
        if dtype.startswith("f"):
            data.flat[::37] = np.nan
            data.flat[5::41] = np.inf if dtype == "float32" else 1e300
        kw = dict(extra)
        if "serializer" not in kw:
            kw["serializer"] = BytesCodec(endian=endian)
        write_array(root / name, data, chunks=(6, 8, 10) if "sharded" not in name else (6, 8, 10), fill_value=3, **kw)
        out[name] = (str(root / name), data)
    return out


def _plan(samples, sample_shape):
    """The plan of one batch, by the planning machinery itself (a planner of its own)."""
    return Planner(Resolver(), damacy.PlanLimits()).plan(samples, sample_shape)


def _assemble_with_twin(plan, out_dtype) -> list[np.ndarray]:
    """What the GPU executor does with a plan: fill, then one assembly launch per table."""
    from damacy_server.decode.chunks import decode_unit
    from damacy_server.store.file import FileReader

    reader = FileReader()
    outs = [np.zeros(shape, dtype=out_dtype) for shape in plan.shapes]
    if plan.fills:
        values = np.array([value for _, value in plan.fills], dtype=plan.metas[0].dtype)
        twin.fill([s for s, _ in plan.fills], values, outs)
    by_table = {}
    for group in plan.groups:
        for u in group.units:
            by_table.setdefault(id(u.table), []).append(u)
    for units in by_table.values():
        units.sort(key=lambda u: u.pos)
        table = units[0].table
        decoded = []
        for u in units:
            data = reader.read_range(u.key, u.offset, u.nbytes) if u.nbytes >= 0 else reader.read(u.key)
            decoded.append(np.ascontiguousarray(decode_unit(u.meta, memoryview(data), u.unit, u.key)))
        tables.check_disjoint(table.rows, table.ndim, table.pool, plan.shapes)
        # the table's unit positions index the units in plan order
        assert [u.pos for u in units] == list(range(len(units)))
        twin.assemble(table.rows, table.ndim, table.pool, decoded, outs)
    return outs


@pytest.mark.parametrize("out", ["float32", "bfloat16", "int16", "uint8", "float16", "native"])
def test_twin_assembly_equals_the_cpu_path(arrays, out):
    rng = np.random.default_rng(3)
    for name, (uri, data) in arrays.items():
        dtype = data.dtype if out == "native" else np.dtype(ml_dtypes.bfloat16 if out == "bfloat16" else out)
        boxes = [tuple((int(a), int(a) + n) for a, n in zip(rng.integers(-3, 14, size=3), (5, 7, 9))) for _ in range(4)]
        for sel in boxes + [np.s_[0:5, 0:7, 0:9]]:
            plan = _plan([damacy.Sample(uri, sel)], (5, 7, 9))
            assert not plan.errors
            got = _assemble_with_twin(plan, dtype)[0]
            want = damacy.read(uri, sel, dtype=dtype, out_of_bounds="pad")
            assert same_bits(got, want), (name, out, sel)


def test_twin_assembly_of_index_queries(arrays):
    uri, data = arrays["u16-zstd"]
    q = damacy.IndexQuery(uri, ([11, 0, 5, 5], np.s_[3:9], [19, 2, 2, 7, 0]))
    plan = _plan([q], (4, 6, 5))
    got = _assemble_with_twin(plan, np.dtype("float32"))[0]
    assert same_bits(got, data[np.ix_([11, 0, 5, 5], range(3, 9), [19, 2, 2, 7, 0])].astype("float32"))


def test_a_table_that_points_outside_is_a_fault_in_the_twin(arrays):
    uri, _ = arrays["u16-zstd"]
    plan = _plan([damacy.Sample(uri, np.s_[0:6, 0:8, 0:10])], (6, 8, 10))
    table = plan.groups[0].units[0].table
    rows = table.rows.copy()
    rows[0, 2 + table.ndim] = 5  # destination start 5 on axis 0 with extent 6: past the sample
    unit = np.zeros((6, 8, 10), dtype=np.uint16)
    with pytest.raises(twin.TwinFault):
        twin.assemble(rows, table.ndim, table.pool, [unit], [np.zeros((6, 8, 10), np.float32)])
    with pytest.raises(tables.OverlappingCopies, match="outside"):
        tables.check_disjoint(rows, table.ndim, table.pool, [(6, 8, 10)])


def test_overlapping_rows_are_refused_before_a_launch():
    ndim = 2
    rows = np.array([[0, 0, 0, 0, 0, 0, 4, 4], [1, 0, 0, 0, 2, 2, 4, 4]], dtype=np.int64)
    with pytest.raises(tables.OverlappingCopies, match="same element"):
        tables.check_disjoint(rows, ndim, np.zeros(0, np.int64), [(8, 8)])
    tables.check_disjoint(rows[:1], ndim, np.zeros(0, np.int64), [(8, 8)])  # one row alone is fine


def _writes(rows, ndim, pool, shapes):
    """Every element's number of writes, per sample (None: a row writes outside)."""
    counts = [np.zeros(shape, dtype=np.int64) for shape in shapes]
    for row in rows:
        axes = [np.arange(s, s + e) if s >= 0 else pool[-s - 1 : -s - 1 + e] for s, e in zip(row[2 + ndim : 2 + 2 * ndim], row[2 + 2 * ndim :])]
        if any(len(p) and (p.min() < 0 or p.max() >= n) for p, n in zip(axes, shapes[row[1]])):
            return None
        np.add.at(counts[row[1]], np.ix_(*axes), 1)
    return counts


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_disjointness_check_agrees_with_counting_every_write(data):
    """Grids of pieces (what the planner makes), grids with a piece repeated or moved, rows
    of any boxes, index lists with repeats: refused exactly when some element is written
    twice or a row writes outside."""
    ndim = data.draw(st.integers(1, 3))
    shapes = [tuple(data.draw(st.integers(1, 6)) for _ in range(ndim)) for _ in range(2)]
    pool: list[int] = []
    rows = []
    for _ in range(data.draw(st.integers(1, 6))):
        sample = data.draw(st.integers(0, 1))
        starts, extents = [], []
        for a in range(ndim):
            n = shapes[sample][a]
            if data.draw(st.booleans()):  # a range
                start = data.draw(st.integers(0, n))
                extents.append(data.draw(st.integers(1, n + 1 - min(start, n - 1))))
                starts.append(start)
            else:  # an index list into the pool
                at = data.draw(st.lists(st.integers(0, n), min_size=1, max_size=4))
                starts.append(-(len(pool) + 1))
                extents.append(len(at))
                pool.extend(at)
        rows.append([0, sample, *([0] * ndim), *starts, *extents])
    if data.draw(st.booleans()):  # a grid over one sample: the pieces per axis, every combination
        cuts = [sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=2)) if n > 1 else [])) for n in shapes[0]]
        pieces = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, shapes[0])]
        rows = [[0, 0, *([0] * ndim), *(lo for lo, _ in combo), *(hi - lo for lo, hi in combo)] for combo in itertools.product(*pieces)]
        if data.draw(st.booleans()):
            rows.append(list(rows[data.draw(st.integers(0, len(rows) - 1))]))  # one piece twice
    rows = np.array(rows, dtype=np.int64)
    pool_ = np.array(pool or [0], dtype=np.int64)
    counts = _writes(rows, ndim, pool_, shapes)
    fine = counts is not None and all(c.max(initial=0) <= 1 for c in counts)
    if fine:
        tables.check_disjoint(rows, ndim, pool_, shapes)
    else:
        with pytest.raises(tables.OverlappingCopies):
            tables.check_disjoint(rows, ndim, pool_, shapes)


def test_fill_converts_like_any_element():
    outs = [np.empty((3, 4), dtype=np.int16) for _ in range(3)]
    twin.fill([0, 2], np.array([np.nan, 1e9], dtype=np.float32), outs)
    assert (outs[0] == 0).all() and (outs[2] == 32767).all()


# -- blosc ------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(typesize=st.sampled_from([1, 2, 4, 8, 3]), n=st.integers(0, 300), extra=st.integers(0, 7), shuffle=st.sampled_from(["noshuffle", "shuffle", "bitshuffle"]), seed=st.integers(0, 2**32 - 1))
def test_twin_unshuffle_is_the_reference(typesize, n, extra, shuffle, seed):
    block = np.random.default_rng(seed).integers(0, 256, size=n * typesize + extra % max(typesize, 1), dtype=np.uint8)
    (got,) = twin.unshuffle([block], typesize, shuffle)
    assert np.array_equal(got, unshuffle_block(block, typesize, shuffle))


@pytest.mark.parametrize("shuffle", ["shuffle", "bitshuffle", "noshuffle"])
def test_twin_unshuffle_decodes_real_blosc_frames(tmp_path, shuffle):
    """Frames written by zarr-python (c-blosc): streams decoded on the host, blocks
    unshuffled by the twin, equal to what zarr-python reads."""
    import zstandard

    from damacy_server.zarr.codecs.blosc import HEADER, parse_frame

    data = random_data((8, 16, 40), "uint16", 9)
    write_array(tmp_path / "b", data, chunks=(8, 16, 40), compressors=[BloscCodec(cname="zstd", shuffle=shuffle, typesize=2, blocksize=2048)])
    frame_bytes = (tmp_path / "b" / "c" / "0" / "0" / "0").read_bytes()
    frame = parse_frame(frame_bytes)
    raw = np.frombuffer(frame_bytes, dtype=np.uint8)
    if frame.memcpyed:
        assert np.array_equal(raw[HEADER.size :].view("<u2").reshape(data.shape), data)
        return
    blocks = [np.empty(frame.block_size(j), dtype=np.uint8) for j in range(-(-frame.nbytes // frame.blocksize))]
    for s in frame.streams:
        src = raw[s.offset : s.offset + s.size].tobytes()
        piece = src if s.raw else zstandard.ZstdDecompressor().decompress(src, max_output_size=s.out_size)
        blocks[s.block][s.out_offset : s.out_offset + s.out_size] = np.frombuffer(piece, dtype=np.uint8)
    out = np.concatenate(twin.unshuffle(blocks, frame.typesize, frame.shuffle))
    assert np.array_equal(out.view("<u2").reshape(data.shape), data)


# -- nvcc ---------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: the kernels' compile check needs it")
@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_kernels_compile_with_nvcc(tmp_path, arch):
    """Every kernel compiles for the lowest architecture CUDA 13 supports and for Hopper;
    register use and spills are reported."""
    out = subprocess.run(
        ["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(KERNELS / "kernels.cu")],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = re.findall(r"Function properties for (\w+)\n.*?(\d+) bytes spill stores.*?\n.*?Used (\d+) registers", out.stderr, re.S)
    names = {name for name, _, _ in report}
    assert {"damacy_assemble", "damacy_fill", "damacy_convert", "damacy_unshuffle"} <= names, out.stderr
    for name, spills, regs in report:
        print(f"{arch} {name}: {regs} registers, {spills} bytes spilled")


def _nvrtc():
    """libnvrtc from the nvidia-cuda-nvrtc wheel (what CuPy compiles RawModules with), or None."""
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("nvidia.cu13")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    builtins = sorted(lib.glob("libnvrtc-builtins.so.*"))
    nvrtc = sorted(lib.glob("libnvrtc.so.*"))
    if not builtins or not nvrtc:
        return None
    ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)  # what libnvrtc opens by name
    return ctypes.CDLL(str(nvrtc[0]))


@pytest.mark.skipif(_nvrtc() is None, reason="NVRTC is not installed (the test extra brings nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_kernels_compile_with_nvrtc(arch):
    """The kernels as the GPU executor builds them (cupy.RawModule compiles with NVRTC, which
    has no C library headers: device.h's NVRTC branch)."""
    import ctypes

    lib = _nvrtc()
    prog = ctypes.c_void_p()
    source = (KERNELS / "kernels.cu").read_bytes()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"kernels.cu", 0, None, None) == 0
    opts = [b"-std=c++17", b"-I" + str(KERNELS).encode(), f"--gpu-architecture={arch}".encode()]
    status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert status == 0, log.value.decode()
    ptx_size = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size))
    ptx = ctypes.create_string_buffer(ptx_size.value)
    lib.nvrtcGetPTX(prog, ptx)
    for name in ("damacy_assemble", "damacy_fill", "damacy_convert", "damacy_unshuffle"):
        assert f".entry {name}(".encode() in ptx.value, name
    lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_the_contract_does_not_depend_on_byte_order():
    """f64 to bf16 rounds once from either byte order (ml_dtypes' astype rounds twice)."""
    x = np.array([1 + 2.0**-8 + 2.0**-30], dtype="<f8")
    little = contract.convert(x, BF16).view(np.uint16)[0]
    big = contract.convert(x.astype(">f8"), BF16).view(np.uint16)[0]
    assert little == big == 0x3F81
