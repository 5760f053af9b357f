"""Host batch slots page-locked where a GPU is present (damacy_runtime.pinning).

No GPU here: a fake CUDA runtime records what is registered, so the tests check that the
process issuing the copies pins every slot once (the embedded pipeline its slots, a daemon
client its mappings of the daemon's segments) and unpins each before its memory goes.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import damacy
from damacy_runtime import pinning

from daemon_helpers import DaemonProcess, wait_for

zarr = pytest.importorskip("zarr")


class FakeRuntime:
    def __init__(self, refuse: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.refuse = refuse

    def cudaHostRegister(self, ptr, size, flags) -> int:
        if self.refuse:
            return 2  # cudaErrorMemoryAllocation
        assert ptr.value not in self.registered and flags.value == 3
        self.registered[ptr.value] = size.value
        return 0

    def cudaHostUnregister(self, ptr) -> int:
        del self.registered[ptr.value]
        return 0


@pytest.fixture
def fake():
    runtime = FakeRuntime()
    before = pinning.pinner()
    pinning.use(pinning.Pinner(runtime))
    yield runtime
    pinning.use(before)


@pytest.fixture
def volume(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    path = str(root / "v.zarr")
    arr = zarr.create_array(path, shape=(16, 16), chunks=(8, 8), dtype="uint16")
    arr[:] = np.arange(256, dtype=np.uint16).reshape(16, 16)
    return root, path


def _read(pipe, path):
    pipe.push([damacy.Sample(path, ((0, 4), (0, 4)))] * 4)
    return [b.copy() for b in pipe.batches()]


def test_an_embedded_pipeline_pins_its_slots_until_their_memory_goes(fake, volume):
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), prepared_batches=3)
    with damacy.Pipeline(cfg, embedded=True) as pipe:
        assert sorted(fake.registered.values()) == [2 * 4 * 4 * 4] * 3  # every slot, whole, once
        pipe.push([damacy.Sample(volume[1], ((0, 4), (0, 4)))] * 2)
        kept = pipe.pop()
        kept.numpy()
    assert fake.registered  # a batch outlives its pipeline: its slot stays pinned
    del kept
    gc.collect()
    assert not fake.registered


def test_a_daemon_client_pins_its_mappings_of_the_slots(fake, volume, tmp_path):
    root, path = volume
    daemon = DaemonProcess(tmp_path, [root])
    try:
        cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), prepared_batches=2)
        with damacy.Pipeline(cfg, endpoint=daemon.endpoint) as pipe:
            assert len(fake.registered) == 2
            assert len(_read(pipe, path)) == 2
        del pipe  # the closed pipeline's mappings go with it
        gc.collect()
        wait_for(lambda: not fake.registered, what="the mappings to be unpinned")
    finally:
        assert daemon.stop() == 0


def test_a_slot_that_cannot_be_pinned_still_serves_batches(volume, caplog):
    runtime = FakeRuntime(refuse=True)
    before = pinning.pinner()
    pinning.use(pinning.Pinner(runtime))
    try:
        cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), prepared_batches=2)
        with damacy.Pipeline(cfg, embedded=True) as pipe:
            assert len(_read(pipe, volume[1])) == 2
        assert "could not page-lock" in caplog.text
    finally:
        pinning.use(before)


def test_pinning_is_asked_for_and_needs_a_device_and_a_loaded_runtime(monkeypatch):
    from damacy_runtime import devices

    monkeypatch.setattr(devices, "cuda_devices", lambda: (1, ""))
    monkeypatch.delenv("DAMACY_PIN_HOST_SLOTS", raising=False)
    assert pinning._load() is None  # off unless asked for
    monkeypatch.setenv("DAMACY_PIN_HOST_SLOTS", "1")
    monkeypatch.setattr(devices, "cuda_devices", lambda: (0, "no device"))
    assert pinning._load() is None
    monkeypatch.setattr(devices, "cuda_devices", lambda: (1, ""))
    loaded = []

    def cdll(name, mode=0):
        loaded.append((name, mode))
        raise OSError("not loaded")

    monkeypatch.setattr(pinning.ctypes, "CDLL", cdll)
    assert pinning._load() is None  # no CUDA runtime in the process: none is loaded for this
    assert loaded and all(mode == os.RTLD_NOLOAD for _, mode in loaded)
