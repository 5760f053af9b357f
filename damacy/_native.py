"""What the seed API names in ``damacy._native``: the call that makes a CUDA context current
(``cuda_init_primary``) and the numbers the value objects are checked against.

damacy has no extension module of that name: its engine is Python and C reached through
:mod:`damacy_server`; this module keeps the seed API's documented entry points working.
"""

from __future__ import annotations

from damacy_protocol import limits as _limits
from damacy_protocol.enums import Dtype, NumaStrategy, Status
from damacy_protocol.errors import DamacyError

__version__ = "0.1.0"

MAX_RANK = _limits.MAX_RANK
MAX_IO_THREADS = _limits.MAX_IO_THREADS
MAX_CHUNK_BYTES = _limits.MAX_CHUNK_BYTES
MAX_READ_OP_BYTES = _limits.UINT32_MAX
N_WAVES = _limits.N_WAVES
MAX_HOST_BUFFER_WAVES = _limits.MAX_HOST_BUFFER_WAVES
HARD_MAX_CHUNKS_PER_WAVE = _limits.HARD_MAX_CHUNKS_PER_WAVE
HARD_MAX_SUBSTREAMS_PER_CHUNK = _limits.HARD_MAX_SUBSTREAMS_PER_CHUNK
DEFAULT_CHUNK_UNCOMPRESSED_BYTES = _limits.DEFAULT_CHUNK_BYTES
DEFAULT_READ_OP_MAX_BYTES = _limits.DEFAULT_READ_BYTES
DEFAULT_MAX_INDEX_BYTES = _limits.DEFAULT_MAX_INDEX_BYTES
DEFAULT_HOST_BUFFER_WAVES = _limits.DEFAULT_HOST_BUFFER_WAVES
DEFAULT_MAX_CHUNKS_PER_WAVE = _limits.DEFAULT_MAX_CHUNKS_PER_WAVE
DEFAULT_MAX_SUBSTREAMS_PER_CHUNK = _limits.DEFAULT_MAX_SUBSTREAMS_PER_CHUNK
DEFAULT_IO_THREADS = _limits.CONFIG_IO_THREADS  # a Config's n_io_threads (a FileReader's own default is 8)
DEFAULT_METADATA_IO_CONCURRENCY = _limits.DEFAULT_METADATA_CONCURRENCY
DEFAULT_ARRAY_META_CACHE = _limits.DEFAULT_ARRAY_ENTRIES
DEFAULT_SHARD_INDEX_CACHE = _limits.DEFAULT_SHARD_INDEX_ENTRIES
DEFAULT_CHUNK_LAYOUT_CACHE = _limits.DEFAULT_CHUNK_LAYOUT_ENTRIES
DEFAULT_MAX_SHARDS_PER_SAMPLE = _limits.DEFAULT_MAX_SHARDS_PER_SAMPLE

from damacy_runtime.logsink import LOG_DEBUG, LOG_ERROR, LOG_FATAL, LOG_INFO, LOG_TRACE, LOG_WARN  # noqa: E402,F401

globals().update({f"DTYPE_{d.name}": int(d) for d in Dtype})
globals().update({f"STATUS_{s.name}": int(s) for s in Status})
globals().update({f"NUMA_{n.name}": int(n) for n in NumaStrategy})
GDS_AUTO, GDS_ON, GDS_OFF = 0, 1, 2


def cuda_init_primary(device: int = 0) -> None:
    """Make CUDA device ``device``'s primary context current in the calling thread, as a
    program without PyTorch or CuPy does before a GPU pipeline whose Config names no device.
    ``RuntimeError`` when the machine has no CUDA device (``DAMACY_DEVICE_STANDIN``: the
    stand-in device 0)."""
    from damacy_runtime.devices import init_primary

    init_primary(device)


def cuda_device_count() -> int:
    """CUDA devices this process sees (the stand-in counts as one)."""
    from damacy_runtime.devices import cuda_devices

    return cuda_devices()[0]


def max_concurrency() -> int:
    """CPUs this process may run on (its affinity), at most :data:`MAX_IO_THREADS`."""
    from damacy_protocol.limits import usable_cpus

    return min(usable_cpus(), MAX_IO_THREADS)


__all__ = ["DamacyError", "cuda_device_count", "cuda_init_primary", "max_concurrency"]
