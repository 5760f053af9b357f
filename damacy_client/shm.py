"""Mapping the daemon's slot segments into a client process."""

from __future__ import annotations

import mmap
import os

import numpy as np

from damacy_protocol.errors import DaemonUnavailable

SHM_DIR = "/dev/shm"


def map_segment(name: str, nbytes: int) -> np.ndarray:
    """The segment ``name`` as a writable uint8 array (the mapping lives as long as it)."""
    if "/" in name or not name.startswith("damacy-"):
        raise DaemonUnavailable(f"the daemon named an unexpected shared-memory segment {name!r}")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except OSError as e:
        raise DaemonUnavailable(f"cannot open the daemon's shared-memory segment {name}: {e.strerror}") from e
    try:
        if os.fstat(fd).st_size < nbytes:
            raise DaemonUnavailable(f"shared-memory segment {name} is smaller than announced")
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=np.uint8)
