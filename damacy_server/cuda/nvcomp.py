"""nvCOMP's batched zstd decoder through ctypes, and the host checks that must come first.

Why ctypes on ``libnvcomp.so`` (wheels ``nvidia-libnvcomp-cu12`` / ``-cu13``) rather than the
``nvidia.nvcomp`` Python codec: the executor decodes every zstd chunk of a batch in one
``nvcompBatchedZstdDecompressAsync`` call straight into its own device arena, with pointer and
size tables it builds once, on its own stream; the low-level C API is exactly that, and its
host-side queries (properties, temp sizing, alignments) answer without a GPU, so the binding
is checked on every machine. The library links the CUDA runtime statically.

nvCOMP's behaviour on corrupt input is undefined, so each frame is walked on the host first
(:func:`walk_zstd_frame`: magic, header, every block header, checksum): a bad frame is its
sample's :class:`DecodeError` before anything reaches the device; a bad status after the
batch is turned into one too (:func:`status_error`).
"""

from __future__ import annotations

import ctypes
import enum
import os
from functools import cache

from damacy_protocol.errors import DecodeError, UnsupportedOperation
from damacy_server.zarr.codecs.base import CorruptData

#: nvCOMP decodes zstd chunks up to 2**31 - 1 bytes (nvcompZstdDecompressionMaxAllowedChunkSize)
MAX_CHUNK_BYTES = (1 << 31) - 1


class Status(enum.IntEnum):
    """``nvcompStatus_t`` (nvcomp/shared_types.h)."""

    SUCCESS = 0
    INVALID_VALUE = 10
    NOT_SUPPORTED = 11
    CANNOT_DECOMPRESS = 12
    BAD_CHECKSUM = 13
    CANNOT_VERIFY_CHECKSUMS = 14
    OUTPUT_BUFFER_TOO_SMALL = 15
    WRONG_HEADER_LENGTH = 16
    ALIGNMENT = 17
    CHUNK_SIZE_TOO_LARGE = 18
    CANNOT_COMPRESS = 19
    WRONG_INPUT_LENGTH = 20
    BATCH_SIZE_TOO_LARGE = 21
    SUB_CHUNK_COUNT_TOO_LARGE = 22
    SUB_CHUNK_COUNT_TOO_SMALL = 23
    OUTPUT_BUFFER_ALIGNMENT_TOO_SMALL = 24
    CUDA_ERROR = 1000
    INTERNAL = 10000


_REASONS = {
    Status.CANNOT_DECOMPRESS: "zstd: the frame cannot be decompressed (corrupt data)",
    Status.BAD_CHECKSUM: "zstd: content checksum mismatch",
    Status.CANNOT_VERIFY_CHECKSUMS: "zstd: the checksum could not be verified",
    Status.OUTPUT_BUFFER_TOO_SMALL: "zstd: the frame decodes to more bytes than the chunk holds",
    Status.WRONG_HEADER_LENGTH: "zstd: bad frame header",
    Status.WRONG_INPUT_LENGTH: "zstd: the frame is not the length its blocks say",
    Status.CHUNK_SIZE_TOO_LARGE: f"zstd: the chunk is larger than nvCOMP decodes ({MAX_CHUNK_BYTES} bytes)",
}


class DecompressBackend(enum.IntEnum):
    DEFAULT = 0
    HARDWARE = 1
    CUDA = 2


class Properties(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


class ZstdDecompressOpts(ctypes.Structure):
    """``nvcompBatchedZstdDecompressOpts_t``: the backend, then reserved bytes (zeroed)."""

    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class LZ4DecompressOpts(ctypes.Structure):
    """``nvcompBatchedLZ4DecompressOpts_t``: the backend, hardware sorting, the data type and
    bitshuffle mode of an inverse bitshuffle (none here), then reserved bytes (zeroed)."""

    _fields_ = [
        ("backend", ctypes.c_int), ("sort_before_hw_decompress", ctypes.c_int), ("data_type", ctypes.c_int),
        ("bitshuffle_mode", ctypes.c_int), ("reserved", ctypes.c_char * 48),
    ]


class AlignmentRequirements(ctypes.Structure):
    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


class NvcompError(RuntimeError):
    """An nvCOMP call failed as a whole (not one chunk's status)."""

    def __init__(self, call: str, status: int) -> None:
        self.status = status
        name = Status(status).name if status in Status._value2member_map_ else str(status)
        super().__init__(f"{call} failed: {name}")


def library_path() -> str | None:
    """libnvcomp.so from the nvidia-libnvcomp wheel, else None (the system's is tried by name)."""
    try:
        import nvidia.libnvcomp as pkg
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(pkg.__file__), "lib64", "libnvcomp.so.6")
    return path if os.path.exists(path) else None


def include_dir() -> str | None:
    """The installed nvCOMP headers (for the tests that check this binding against them)."""
    path = library_path()
    return os.path.join(os.path.dirname(os.path.dirname(path)), "include") if path else None


@cache
def load() -> ctypes.CDLL:
    """libnvcomp with its functions typed; UnsupportedOperation naming the extra when absent."""
    try:
        lib = ctypes.CDLL(library_path() or "libnvcomp.so.6", ctypes.RTLD_LOCAL)
    except OSError as e:
        raise UnsupportedOperation(f"nvCOMP is not installed ({e}); install damacy[cuda12] or damacy[cuda13]") from None
    size_t, p = ctypes.c_size_t, ctypes.c_void_p
    lib.nvcompGetProperties.argtypes = [ctypes.POINTER(Properties)]
    lib.nvcompBatchedZstdDecompressGetTempSize.argtypes = [
        size_t, size_t, ZstdDecompressOpts, ctypes.POINTER(size_t), size_t, p,
    ]
    lib.nvcompBatchedZstdDecompressGetRequiredAlignments.argtypes = [
        ZstdDecompressOpts, ctypes.POINTER(AlignmentRequirements),
    ]
    # (compressed ptrs, compressed bytes, buffer bytes, actual bytes out, n, temp, temp bytes,
    #  output ptrs, opts, statuses out, stream): every pointer a device pointer
    lib.nvcompBatchedZstdDecompressAsync.argtypes = [p, p, p, p, size_t, p, size_t, p, ZstdDecompressOpts, p, p]
    lib.nvcompBatchedLZ4DecompressGetTempSize.argtypes = [size_t, size_t, LZ4DecompressOpts, ctypes.POINTER(size_t), size_t, p]
    lib.nvcompBatchedLZ4DecompressAsync.argtypes = [p, p, p, p, size_t, p, size_t, p, LZ4DecompressOpts, p, p]
    for f in (
        lib.nvcompBatchedLZ4DecompressGetTempSize,
        lib.nvcompBatchedLZ4DecompressAsync,
        lib.nvcompGetProperties,
        lib.nvcompBatchedZstdDecompressGetTempSize,
        lib.nvcompBatchedZstdDecompressGetRequiredAlignments,
        lib.nvcompBatchedZstdDecompressAsync,
    ):
        f.restype = ctypes.c_int
    return lib


def _opts(backend: DecompressBackend = DecompressBackend.DEFAULT) -> ZstdDecompressOpts:
    return ZstdDecompressOpts(backend=int(backend))


def _ok(call: str, status: int) -> None:
    if status != Status.SUCCESS:
        raise NvcompError(call, status)


def properties() -> tuple[str, int]:
    """(nvCOMP version "major.minor.patch", CUDA runtime version it was built with)."""
    props = Properties()
    _ok("nvcompGetProperties", load().nvcompGetProperties(ctypes.byref(props)))
    v = props.version
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}", props.cudart_version


def zstd_temp_bytes(num_chunks: int, max_chunk_bytes: int, total_bytes: int) -> int:
    """Device scratch the batched zstd decoder needs for ``num_chunks`` chunks of at most
    ``max_chunk_bytes`` (``total_bytes`` decoded in all); sized once per batch shape."""
    out = ctypes.c_size_t()
    status = load().nvcompBatchedZstdDecompressGetTempSize(
        num_chunks, max_chunk_bytes, _opts(), ctypes.byref(out), total_bytes, None
    )
    _ok("nvcompBatchedZstdDecompressGetTempSize", status)
    return out.value


def lz4_temp_bytes(num_chunks: int, max_chunk_bytes: int, total_bytes: int) -> int:
    """As :func:`zstd_temp_bytes`, for the batched LZ4 decoder."""
    out = ctypes.c_size_t()
    status = load().nvcompBatchedLZ4DecompressGetTempSize(
        num_chunks, max_chunk_bytes, LZ4DecompressOpts(backend=int(DecompressBackend.DEFAULT)), ctypes.byref(out), total_bytes, None
    )
    _ok("nvcompBatchedLZ4DecompressGetTempSize", status)
    return out.value


def zstd_alignments() -> AlignmentRequirements:
    """Alignment nvCOMP requires of input, output and scratch buffers (bytes)."""
    out = AlignmentRequirements()
    _ok("nvcompBatchedZstdDecompressGetRequiredAlignments", load().nvcompBatchedZstdDecompressGetRequiredAlignments(_opts(), ctypes.byref(out)))
    return out


def status_error(
    status: int, *, uri: str | None, path: str | None, chunk: tuple[int, ...] | None, codec: str = "zstd"
) -> DecodeError | None:
    """A chunk's status after a batch, as its sample's error (None when it succeeded)."""
    if status == Status.SUCCESS:
        return None
    known = Status(status) if status in Status._value2member_map_ else None
    reason = _REASONS.get(known) if known is not None else None
    if reason is None:
        reason = f"zstd: nvCOMP could not decode the chunk ({known.name if known is not None else status})"
    if codec != "zstd":
        reason = codec + reason[len("zstd"):]
    return DecodeError(reason, uri=uri, path=path, chunk=chunk)


# -- host checks before a frame reaches the device -------------------------------------------

_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50
_BLOCK_MAX = 128 << 10


def walk_zstd_frame(data, expected_size: int | None = None) -> tuple[int | None, int]:
    """Check one zstd frame's structure without decoding it: magic, frame header, every block
    header (sizes within the frame and the block limit), the checksum's room, nothing after
    the frame. Returns (content size if the header holds it, bytes the blocks decode to at
    most). :class:`CorruptData` says what is wrong; a frame whose header names a content size
    other than ``expected_size`` is refused too."""
    buf = memoryview(data).cast("B")
    n = len(buf)
    if n < 6:
        raise CorruptData(f"zstd: {n} bytes is too short for a frame")
    magic = int.from_bytes(buf[0:4], "little")
    if magic & 0xFFFFFFF0 == _SKIPPABLE:
        raise CorruptData("zstd: a skippable frame where a chunk's frame should be")
    if magic != _MAGIC:
        raise CorruptData(f"zstd: bad magic number {magic:#010x}")
    fhd = buf[4]
    fcs_flag, single, reserved, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 3) & 1, (fhd >> 2) & 1, fhd & 3
    if reserved:
        raise CorruptData("zstd: reserved frame header bit set")
    pos = 5
    window = 0
    if not single:
        if pos >= n:
            raise CorruptData("zstd: truncated frame header")
        wd = buf[pos]
        exponent, mantissa = wd >> 3, wd & 7
        base = 1 << (10 + exponent)
        window = base + base // 8 * mantissa
        pos += 1
    pos += (0, 1, 2, 4)[dict_flag]
    fcs_bytes = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if pos + fcs_bytes > n:
        raise CorruptData("zstd: truncated frame header")
    content = None
    if fcs_bytes:
        content = int.from_bytes(buf[pos : pos + fcs_bytes], "little") + (256 if fcs_bytes == 2 else 0)
    pos += fcs_bytes
    if single:
        window = content
    if content is not None and expected_size is not None and content != expected_size:
        raise CorruptData(f"zstd: the frame holds {content} bytes, the chunk {expected_size}")
    block_max = min(_BLOCK_MAX, window) if window is not None and window > 0 else _BLOCK_MAX
    decoded_max = 0
    while True:
        if pos + 3 > n:
            raise CorruptData("zstd: truncated block header")
        header = int.from_bytes(buf[pos : pos + 3], "little")
        pos += 3
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise CorruptData("zstd: reserved block type")
        if kind == 1:  # RLE: one byte stored, `size` bytes decoded
            stored, decoded = 1, size
        else:
            stored, decoded = size, size if kind == 0 else block_max
        if size > block_max:
            raise CorruptData(f"zstd: a block of {size} bytes, more than the {block_max} allowed")
        if pos + stored > n:
            raise CorruptData("zstd: truncated block")
        pos += stored
        decoded_max += decoded
        if last:
            break
    if checksum:
        pos += 4
    if pos != n:
        raise CorruptData(f"zstd: the frame ends at byte {pos}, the chunk has {n}" if pos < n else "zstd: truncated checksum")
    return content, decoded_max


def walk_lz4_block(data, expected_size: int) -> None:
    """Check a raw LZ4 block (a Blosc stream) decodes to exactly ``expected_size`` bytes
    without reading or writing outside its buffers; :class:`CorruptData` naming the fault.
    The native path's C walker when built (the same rules), else this Python one."""
    from damacy_server import native

    if native.available():
        why = native._assemble.check_lz4(data, expected_size)
    else:
        why = _walk_lz4(memoryview(data).cast("B"), expected_size)
    if why is not None:
        raise CorruptData(f"lz4: {why}")


def _length(block: memoryview, i: int, value: int) -> tuple[int, int] | None:
    """An LZ4 length whose 4-bit field is full (15): the bytes after it add up while they
    are 255. (length, next position), or None when the bytes run past the block."""
    n = len(block)
    while True:
        if i >= n:
            return None
        b = block[i]
        i += 1
        value += b
        if b != 255:
            return value, i


def _walk_lz4(block: memoryview, size: int) -> str | None:
    n, i, out = len(block), 0, 0
    if n == 0:
        return "an empty block"
    while True:
        token = block[i]
        i += 1
        lit = token >> 4
        if lit == 15:
            got = _length(block, i, lit)
            if got is None:
                return "a literal length runs past the block"
            lit, i = got
        if lit > n - i:
            return "literals run past the block"
        if lit > size - out:
            return "the block decodes to more bytes than the chunk holds"
        i += lit
        out += lit
        if i == n:
            break
        if n - i < 2:
            return "a truncated match offset"
        offset = block[i] | (block[i + 1] << 8)
        i += 2
        if offset == 0 or offset > out:
            return "a match refers before the start of the output"
        match = token & 15
        if match == 15:
            got = _length(block, i, match)
            if got is None:
                return "a match length runs past the block"
            match, i = got
        match += 4
        if match > size - out:
            return "the block decodes to more bytes than the chunk holds"
        if size < 12 or out > size - 12:  # LZ4's end of block (see lz4.c)
            return "a match starts in the last 12 bytes of the chunk (LZ4 leaves them to literals)"
        if match > size - 5 - out:
            return "a match ends in the last 5 bytes of the chunk (LZ4 ends a block with 5 literals)"
        out += match
        if i >= n:
            return "the block ends with a match, not literals"
    return None if out == size else "the block decodes to fewer bytes than the chunk holds"
