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


@needs_nvcomp
def test_the_decompress_call_takes_the_arguments_the_header_declares():
    header = (Path(nvcomp.include_dir()) / "nvcomp" / "zstd.h").read_text()
    decl = re.search(r"nvcompStatus_t nvcompBatchedZstdDecompressAsync\((.*?)\);", header, re.S).group(1)
    params = [p.strip() for p in decl.split(",")]
    assert len(params) == len(nvcomp.load().nvcompBatchedZstdDecompressAsync.argtypes)
    assert "nvcompBatchedZstdDecompressOpts_t" in params[8] and "cudaStream_t" in params[10]
    temp = re.search(r"nvcompStatus_t nvcompBatchedZstdDecompressGetTempSize\((.*?)\);", header, re.S).group(1)
    assert len(temp.split(",")) == len(nvcomp.load().nvcompBatchedZstdDecompressGetTempSize.argtypes)


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
