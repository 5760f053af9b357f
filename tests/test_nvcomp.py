"""damacy's nvCOMP binding, checked without a GPU: struct layouts and status codes against the
installed header, the host-side queries (properties, temp sizing, alignments), the mapping
of chunk statuses to errors, and the host walk of zstd frames that guards nvCOMP from
corrupt input."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from damacy_protocol.errors import DecodeError
from damacy_server.cuda import nvcomp
from damacy_server.zarr.codecs.base import CorruptData


def _loadable() -> bool:
    try:
        nvcomp.load()
    except Exception:
        return False
    return True


needs_nvcomp = pytest.mark.skipif(not _loadable(), reason="libnvcomp is not installed (the test extra brings nvidia-libnvcomp-cu13)")


@needs_nvcomp
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler to read the header's layouts")
def test_structs_and_statuses_match_the_header(tmp_path):
    include = nvcomp.include_dir()
    names = [s.name for s in nvcomp.Status]
    c_names = {
        "SUCCESS": "nvcompSuccess",
        **{n: "nvcompError" + "".join(w.capitalize() for w in n.split("_")) for n in names if n != "SUCCESS"},
    }
    c_names["CUDA_ERROR"] = "nvcompErrorCudaError"
    prog = tmp_path / "layout.c"
    prog.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"nvcomp.h\"\nint main(void) {\n"
        '  printf("opts %zu %zu\\n", sizeof(nvcompBatchedZstdDecompressOpts_t), offsetof(nvcompBatchedZstdDecompressOpts_t, backend));\n'
        '  printf("align %zu %zu %zu\\n", sizeof(nvcompAlignmentRequirements_t), offsetof(nvcompAlignmentRequirements_t, output), offsetof(nvcompAlignmentRequirements_t, temp));\n'
        '  printf("props %zu\\n", sizeof(nvcompProperties_t));\n'
        '  printf("status %d\\n", (int)sizeof(nvcompStatus_t));\n'
        + "".join(f'  printf("{n} %d\\n", (int){c});\n' for n, c in c_names.items())
        + '  printf("backend %d %d %d\\n", NVCOMP_DECOMPRESS_BACKEND_DEFAULT, NVCOMP_DECOMPRESS_BACKEND_HARDWARE, NVCOMP_DECOMPRESS_BACKEND_CUDA);\n'
        + '  printf("lz4opts %zu %zu %zu %zu\\n", sizeof(nvcompBatchedLZ4DecompressOpts_t), offsetof(nvcompBatchedLZ4DecompressOpts_t, sort_before_hw_decompress), offsetof(nvcompBatchedLZ4DecompressOpts_t, data_type), offsetof(nvcompBatchedLZ4DecompressOpts_t, bitshuffle_mode));\n'
        + '  printf("max %zu\\n", nvcompZstdDecompressionMaxAllowedChunkSize);\n  return 0;\n}\n'
    )
    exe = tmp_path / "layout"
    build = subprocess.run(["gcc", "-I", include, str(prog), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    out = dict(line.split(" ", 1) for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines())
    assert out["opts"].split() == [str(ctypes.sizeof(nvcomp.ZstdDecompressOpts)), str(nvcomp.ZstdDecompressOpts.backend.offset)]
    assert out["align"].split() == [str(ctypes.sizeof(nvcomp.AlignmentRequirements)), str(nvcomp.AlignmentRequirements.output.offset), str(nvcomp.AlignmentRequirements.temp.offset)]
    assert out["props"] == str(ctypes.sizeof(nvcomp.Properties))
    assert out["status"] == str(ctypes.sizeof(ctypes.c_int))  # returned as a C int
    for name in names:
        assert int(out[name]) == nvcomp.Status[name].value, name
    assert [int(v) for v in out["backend"].split()] == [b.value for b in nvcomp.DecompressBackend]
    assert int(out["max"]) == nvcomp.MAX_CHUNK_BYTES
    L = nvcomp.LZ4DecompressOpts
    assert [int(v) for v in out["lz4opts"].split()] == [
        ctypes.sizeof(L), L.sort_before_hw_decompress.offset, L.data_type.offset, L.bitshuffle_mode.offset
    ]


@needs_nvcomp
@pytest.mark.parametrize("codec, header_name", [("Zstd", "zstd.h"), ("LZ4", "lz4.h")])
def test_the_decompress_call_takes_the_arguments_the_header_declares(codec, header_name):
    header = (Path(nvcomp.include_dir()) / "nvcomp" / header_name).read_text()
    lib = nvcomp.load()
    decl = re.search(rf"nvcompStatus_t nvcompBatched{codec}DecompressAsync\((.*?)\);", header, re.S).group(1)
    params = [p.strip() for p in decl.split(",")]
    assert len(params) == len(getattr(lib, f"nvcompBatched{codec}DecompressAsync").argtypes)
    assert f"nvcompBatched{codec}DecompressOpts_t" in params[8] and "cudaStream_t" in params[10]
    temp = re.search(rf"nvcompStatus_t nvcompBatched{codec}DecompressGetTempSize\((.*?)\);", header, re.S).group(1)
    assert len(temp.split(",")) == len(getattr(lib, f"nvcompBatched{codec}DecompressGetTempSize").argtypes)
    assert nvcomp.lz4_temp_bytes(64, 64 << 10, 64 * (64 << 10)) >= 0  # host queries, answered without a GPU


@needs_nvcomp
def test_host_queries_answer_without_a_gpu():
    version, cudart = nvcomp.properties()
    header = (Path(nvcomp.include_dir()) / "nvcomp" / "version.h").read_text()
    major = re.search(r"NVCOMP_VER_MAJOR (\d+)", header).group(1)
    assert version.split(".")[0] == major and cudart > 0
    one = nvcomp.zstd_temp_bytes(1, 256 << 10, 256 << 10)
    many = nvcomp.zstd_temp_bytes(512, 256 << 10, 512 * (256 << 10))
    assert 0 < one < many  # sized per chunk: the executor sizes it once per batch shape
    with pytest.raises(nvcomp.NvcompError, match="CHUNK_SIZE_TOO_LARGE"):
        nvcomp.zstd_temp_bytes(1, 1 << 31, 1 << 31)
    align = nvcomp.zstd_alignments()
    for v in (align.input, align.output, align.temp):
        assert v >= 1 and v & (v - 1) == 0


def test_chunk_statuses_become_errors_of_their_samples():
    assert nvcomp.status_error(0, uri="/a", path="/a/c/0", chunk=(0,)) is None
    lz4 = nvcomp.status_error(nvcomp.Status.CANNOT_DECOMPRESS, uri="/a", path="/a/c/0", chunk=(0,), codec="lz4")
    assert lz4.reason.startswith("lz4: ") and "zstd" not in lz4.reason
    for status in nvcomp.Status:
        if status == nvcomp.Status.SUCCESS:
            continue
        err = nvcomp.status_error(int(status), uri="/a", path="/a/c/1", chunk=(1,))
        assert isinstance(err, DecodeError) and err.chunk == (1,) and err.path == "/a/c/1" and "zstd" in err.reason
    assert "checksum" in nvcomp.status_error(13, uri=None, path=None, chunk=None).reason
    assert "77" in nvcomp.status_error(77, uri=None, path=None, chunk=None).reason  # unknown codes still say which


def _frame(size: int, level: int, checksum: bool, content_size: bool = True) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(size + level)
    data = (np.cumsum(rng.integers(-3, 4, size=size // 2)) % 4096).astype("<u2").tobytes()
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=checksum, write_content_size=content_size)
    return data, cctx.compress(data)


@pytest.mark.parametrize("level", [-5, 3, 19])
@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("size", [4 << 10, 300 << 10, 4 << 20])
def test_frames_zarr_writes_pass_the_walk(level, checksum, size):
    data, frame = _frame(size, level, checksum)
    content, most = nvcomp.walk_zstd_frame(frame, len(data))
    assert content == len(data) and most >= len(data)
    _, streamed = _frame(size, level, checksum, content_size=False)
    assert nvcomp.walk_zstd_frame(streamed, len(data))[0] is None


def test_broken_frames_are_refused_before_the_device():
    data, frame = _frame(300 << 10, 3, True)
    with pytest.raises(CorruptData, match="truncated"):
        nvcomp.walk_zstd_frame(frame[:-7], len(data))
    with pytest.raises(CorruptData, match="ends at byte"):
        nvcomp.walk_zstd_frame(frame + b"\0", len(data))
    with pytest.raises(CorruptData, match="magic"):
        nvcomp.walk_zstd_frame(b"\0" + frame[1:], len(data))
    with pytest.raises(CorruptData, match="holds"):
        nvcomp.walk_zstd_frame(frame, len(data) + 2)
    with pytest.raises(CorruptData, match="too short"):
        nvcomp.walk_zstd_frame(frame[:5])


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, 10_000), value=st.integers(0, 255), cut=st.integers(0, 64))
def test_a_mutated_frame_is_walked_or_refused_never_a_crash(pos, value, cut):
    data, frame = _frame(64 << 10, 3, False)
    mutated = bytearray(frame[: len(frame) - cut])
    if mutated:
        mutated[pos % len(mutated)] = value
    try:
        content, most = nvcomp.walk_zstd_frame(bytes(mutated), len(data))
    except CorruptData:
        return
    assert most <= (len(mutated) // 3 + 1) * (128 << 10)  # bounded by what the blocks can say


# -- LZ4 blocks (Blosc's lz4 and lz4hc streams) ------------------------------------------------


def _lz4_streams(cname: str, seed: int) -> list[tuple[bytes, int]]:
    """The compressed streams of Blosc frames written by C-Blosc (numcodecs)."""
    from numcodecs import Blosc

    from damacy_server.zarr.codecs.blosc import parse_frame

    rng = np.random.default_rng(seed)
    data = (np.cumsum(rng.integers(-3, 4, size=40_000)) % 300).astype(np.uint16)
    frame = Blosc(cname=cname, clevel=5, shuffle=Blosc.SHUFFLE, blocksize=8192).encode(data)
    parsed = parse_frame(memoryview(frame))
    streams = [(bytes(frame[st.offset : st.offset + st.size]), st.out_size) for st in parsed.streams if not st.raw]
    assert streams  # compressible data: Blosc compressed it
    return streams


def _verdicts(block: bytes, size: int) -> tuple:
    from damacy_server import native

    py = nvcomp._walk_lz4(memoryview(block), size)
    c = native._assemble.check_lz4(block, size) if native.available() else py
    return py, c


@pytest.mark.parametrize("cname", ["lz4", "lz4hc"])
def test_lz4_streams_blosc_writes_pass_the_walk(cname):
    for block, size in _lz4_streams(cname, 1):
        assert _verdicts(block, size) == (None, None)
        nvcomp.walk_lz4_block(block, size)
        py, _ = _verdicts(block, size + 1)
        assert py == "the block decodes to fewer bytes than the chunk holds"
        # one byte short: its last match would reach into the last 5 bytes, or past the end
        short = _verdicts(block, size - 1)
        assert short[0] == short[1] and short[0] in (
            "the block decodes to more bytes than the chunk holds",
            "a match ends in the last 5 bytes of the chunk (LZ4 ends a block with 5 literals)",
        )


def test_lz4_end_of_block_rules_are_the_reference_decoders():
    """A match in the last 12 bytes, or reaching into the last 5, is refused by LZ4's
    reference decoder (C-Blosc's, the CPU path): the walk before nvCOMP refuses it too."""
    import struct

    from numcodecs import lz4

    for block, size, accepted in [
        (bytes([0x42]) + b"abcd" + bytes([1, 0]) + bytes([0x00]), 10, False),  # a match ending the block
        (bytes([0x90]) + b"abcdefghi" + bytes([1, 0]) + bytes([0x70]) + b"jklmnop", 20, False),  # starting 11 from the end
        (bytes([0x80]) + b"abcdefgh" + bytes([1, 0]) + bytes([0x80]) + b"jklmnopq", 20, True),  # 12 from the end
        (bytes([0x40]) + b"abcd" + bytes([4, 0]) + bytes([0xC0]) + b"efghijklmnop", 20, True),
    ]:
        py, c = _verdicts(block, size)
        assert py == c and (py is None) == accepted, py
        try:
            decoded = len(lz4.decompress(struct.pack("<I", size) + block)) == size
        except Exception:
            decoded = False
        assert decoded == accepted


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, 10_000), value=st.integers(0, 255), cut=st.integers(0, 40))
def test_a_mutated_lz4_block_is_refused_or_decodes_to_its_size_never_past_it(pos, value, cut):
    """The C and Python walks agree on every mutation, and whatever they accept decodes (by
    the reference LZ4 decoder) to exactly the chunk's size."""
    import struct

    from numcodecs import lz4

    block, size = _lz4_streams("lz4", 2)[0]
    mutated = bytearray(block)
    mutated[pos % len(mutated)] = value
    mutated = bytes(mutated[: len(mutated) - cut])
    py, c = _verdicts(mutated, size)
    assert py == c
    if py is None:
        assert len(lz4.decompress(struct.pack("<I", size) + mutated)) == size
    else:
        with pytest.raises(CorruptData, match="^lz4: "):
            nvcomp.walk_lz4_block(mutated, size)
