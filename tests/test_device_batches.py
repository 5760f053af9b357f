"""Batches in device slots: DLPack with CUDA stream semantics and deferred release.

The device here is the host stand-in made to look like a GPU (its memory is not readable as
numpy arrays, its DLPack device is kDLCUDA) and to log every event it records and waits
for, so the tests check the order a GPU would follow: the consumer's stream waits for the
batch's ready event, a release fences the slot on each consumer stream, and the executor's
stream waits for those fences before it writes the slot again. A consumer is simulated as
torch and CuPy behave: it takes the capsule (renaming it ``used_dltensor``) and calls the
tensor's deleter when it drops the tensor.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import damacy
from damacy_protocol.limits import DEFAULT_GPU_MEMORY_BYTES
from damacy_runtime import dlpack
from damacy_runtime.device import ExternalEvent
from damacy_server.cuda import twin
from damacy_server.cuda.device import HostDevice
from damacy_server.cuda.executor import CudaExecutor

from pipeline_helpers import DAMACY_OWN

#: the stand-in device runs the kernels' host twin, built with a C compiler
needs_twin = pytest.mark.skipif(not twin.available(), reason="the kernels' host twin was not built (no C compiler)")

_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))
_USED = {False: b"used_dltensor", True: b"used_dltensor_versioned"}


class Event:
    def __init__(self, n: int, stream) -> None:
        self.n, self.stream = n, stream

    def __repr__(self) -> str:
        return f"E{self.n}@{self.stream}"


class LoggingGpu(HostDevice):
    """The stand-in device, seen from outside as GPU 0, logging the stream order."""

    name = "cuda:0"
    dlpack_device = (dlpack.KDL_CUDA, 0)
    host_accessible = False

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._n = 0

    def record_event(self, stream=None):
        with self._lock:
            self._n += 1
            event = Event(self._n, stream)
            self.log.append(("record", event, stream))
        return event

    def wait_event(self, event, stream=None) -> None:
        with self._lock:
            self.log.append(("wait", event, stream))

    def launch(self, kernel, grid, block, args) -> None:
        with self._lock:
            self.log.append(("launch", kernel))
        super().launch(kernel, grid, block, args)

    def copy(self, dst, src, nbytes) -> None:
        with self._lock:
            self.log.append(("copy",))
        super().copy(dst, src, nbytes)

    @property
    def stream_handle(self) -> int:
        return 0x5EED


class Consumer:
    """What torch.from_dlpack does with a capsule: take it, keep the tensor, delete it."""

    def __init__(self, batch, stream, versioned: bool = True) -> None:
        kwargs = {"max_version": (1, 0)} if versioned else {}
        self.capsule = batch.__dlpack__(stream=stream, **kwargs)
        name = b"dltensor_versioned" if versioned else b"dltensor"
        ptr = _get_pointer(self.capsule, name)
        kind = dlpack.DLManagedTensorVersioned if versioned else dlpack.DLManagedTensor
        self.managed = kind.from_address(ptr)
        self.ptr = ptr
        assert _set_name(self.capsule, _USED[versioned]) == 0  # taken: the capsule no longer owns it

    @property
    def tensor(self) -> dlpack.DLTensor:
        return self.managed.dl_tensor

    def drop(self) -> None:
        self.managed.deleter(self.ptr)


@pytest.fixture
def volume(tmp_path):
    zarr = pytest.importorskip("zarr")
    path = str(tmp_path / "v.zarr")
    arr = zarr.create_array(path, shape=(32, 32), chunks=(8, 8), dtype="uint16", compressors=zarr.codecs.ZstdCodec())
    data = np.arange(32 * 32, dtype=np.uint16).reshape(32, 32)
    arr[:] = data
    return path, data


def _pipe(device, dtype="float32", slots=1, **kw):
    """A pipeline composed with the CUDA executor on ``device`` (``backend=``), which it
    claims and closes as it closes; damacy's own policies unless ``kw`` says otherwise."""
    executor = CudaExecutor(
        reader=damacy.FileReader(), limits=damacy.CudaLimits(max_gpu_memory_bytes=DEFAULT_GPU_MEMORY_BYTES), backend=device
    )
    planner = damacy.ChunkPlanner(metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache()))
    return damacy.Pipeline(
        planner=planner,
        executor=executor,
        output=damacy.BatchSpec(2, (4, 4), dtype),
        queues=damacy.QueueLimits(lookahead_samples=4, prepared_batches=slots),
        pop_timeout_s=60,
        **{**DAMACY_OWN, **kw},
    )


def _boxes(path, starts):
    return [damacy.Sample(path, ((y, y + 4), (x, x + 4))) for y, x in starts]


@needs_twin
def test_a_consumer_stream_waits_for_the_batch_and_its_release_fences_the_next_write(volume):
    path, data = volume
    gpu = LoggingGpu()
    with _pipe(gpu) as pipe:
        pipe.push(_boxes(path, [(0, 0), (4, 4), (8, 8), (12, 12)]))
        batch = pipe.pop()
        assert batch.info.device == "cuda:0" and batch.info.ready_stream == 0x5EED
        assert batch.info.device_type is damacy.DeviceType.CUDA and batch.info.device_id == 0
        assert batch.__dlpack_device__() == (dlpack.KDL_CUDA, 0)
        ready = [e for kind, e, *_ in (x for x in gpu.log if x[0] == "record") if e.stream is None][-1]
        # the ready event is recorded on the executor's stream after the batch's last kernel
        last_launch = max(i for i, x in enumerate(gpu.log) if x[0] == "launch")
        assert gpu.log.index(("record", ready, None)) > last_launch

        consumer = Consumer(batch, stream=77)
        assert ("wait", ready, 77) in gpu.log  # the consumer's stream waits; no host wait
        t = consumer.tensor
        assert (t.device.device_type, t.device.device_id) == (dlpack.KDL_CUDA, 0)
        assert t.data == batch.info.device_ptr
        assert [t.shape[k] for k in range(t.ndim)] == [2, 4, 4]
        assert [t.strides[k] for k in range(t.ndim)] == [16, 4, 1]
        assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (dlpack.KDL_FLOAT, 32, 1)
        np.testing.assert_array_equal(batch.copy(), np.stack([data[0:4, 0:4], data[4:8, 4:8]]).astype(np.float32))

        batch.release()  # the tensor still holds the slot: nothing is fenced or written yet
        n = len(gpu.log)
        assert not pipe.engine.free_slots()
        consumer.drop()  # torch frees the tensor
        fence = gpu.log[n][1]
        assert gpu.log[n] == ("record", fence, 77)  # fenced on the consumer's stream

        second = pipe.pop()  # assembled into the same (only) slot
        after = gpu.log[n + 1 :]
        wait_at = after.index(("wait", fence, None))
        first_write = min(i for i, x in enumerate(after) if x[0] == "launch" and x[1] in ("assemble", "fill"))
        assert wait_at < first_write  # the executor's stream waited for the consumer first
        np.testing.assert_array_equal(second.copy(), np.stack([data[8:12, 8:12], data[12:16, 12:16]]).astype(np.float32))
        second.release()


HANDLE = 0xE7E47  # a raw CUevent handle, as the caller's framework holds it


class TorchEvent:
    """torch.cuda.Event: its raw handle is ``cuda_event``."""

    def __init__(self, handle: int) -> None:
        self.cuda_event = handle


class TorchStream:
    """torch.cuda.Stream: ``record_event()`` records a new event on it."""

    def __init__(self, handle: int) -> None:
        self.handle, self.recorded = handle, 0

    def record_event(self):
        self.recorded += 1
        return TorchEvent(self.handle)


class CupyEvent:
    """cupy.cuda.Event: its raw handle is the int ``ptr``."""

    def __init__(self, handle: int) -> None:
        self.ptr = handle


class CupyStream:
    """cupy.cuda.Stream: ``record()`` records a new event on it (and it has ``wait_event``)."""

    def __init__(self, handle: int) -> None:
        self.handle, self.recorded = handle, 0

    def record(self, event=None):
        self.recorded += 1
        return CupyEvent(self.handle)

    def wait_event(self, event) -> None:
        raise AssertionError("release records on the stream; it does not make it wait")


EVENT_FORMS = {
    "int": lambda: HANDLE,
    "torch-stream": lambda: TorchStream(HANDLE),
    "torch-event": lambda: TorchEvent(HANDLE),
    "cupy-event": lambda: CupyEvent(HANDLE),
    "cupy-stream": lambda: CupyStream(HANDLE),
}


def _waits_on_external(log: list, start: int) -> list[int]:
    """Where in ``log[start:]`` the executor's stream waits for caller events."""
    return [i for i, x in enumerate(log[start:]) if x[0] == "wait" and isinstance(x[1], ExternalEvent) and x[2] is None]


@needs_twin
@pytest.mark.parametrize("form", sorted(EVENT_FORMS))
def test_a_release_with_an_event_makes_the_slots_next_write_wait_for_it(volume, form):
    """``batch.release(event=...)`` returns at once; the slot's next batch is written only
    after the executor's stream waited for that event (each form the seed API takes)."""
    path, data = volume
    gpu = LoggingGpu()
    with _pipe(gpu) as pipe:  # one slot: the next batch goes where this one was
        pipe.push(_boxes(path, [(0, 0), (4, 4), (8, 8), (12, 12)]))
        batch = pipe.pop()
        event = EVENT_FORMS[form]()
        n = len(gpu.log)
        assert not _waits_on_external(gpu.log, 0)
        batch.release(event=event)
        assert getattr(event, "recorded", 1) == 1  # a stream: one event recorded on it, now
        assert batch._slot is None and repr(batch) == "Batch(<released>)"  # released at once, no host wait
        second = pipe.pop()
        after = gpu.log[n:]
        waits = _waits_on_external(gpu.log, n)
        assert [after[i][1].ptr for i in waits] == [HANDLE]  # that event, waited for on the executor's stream
        owner = after[waits[0]][1].owner  # the event object, alive until the wait (its handle dies with it)
        assert owner is None if form == "int" else isinstance(owner, (TorchEvent, CupyEvent))
        if form.endswith("event"):
            assert owner is event
        first_write = min(i for i, x in enumerate(after) if x[0] == "launch" and x[1] in ("assemble", "fill"))
        assert waits[0] < first_write  # before the slot was written again
        np.testing.assert_array_equal(second.copy(), np.stack([data[8:12, 8:12], data[12:16, 12:16]]).astype(np.float32))
        second.release()
        batch.release(event=event)  # idempotent: a released batch fences nothing more
        assert _waits_on_external(gpu.log, n) == waits


@needs_twin
def test_a_release_event_on_the_stand_in_device_orders_the_next_write(volume, monkeypatch):
    """The same through a Config naming GPU 0, the host stand-in (DAMACY_DEVICE_STANDIN):
    its stream waits for the event before it writes the slot again."""
    from damacy_runtime.devices import STANDIN_ENV

    path, data = volume
    monkeypatch.setenv(STANDIN_ENV, "1")
    log: list = []
    real_wait, real_launch = HostDevice.wait_event, HostDevice.launch
    monkeypatch.setattr(HostDevice, "wait_event", lambda self, event, stream=None: (log.append(("wait", event, stream)), real_wait(self, event, stream))[1])
    monkeypatch.setattr(HostDevice, "launch", lambda self, kernel, *a: (log.append(("launch", kernel)), real_launch(self, kernel, *a))[1])
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), device=0, prepared_batches=1)
    with damacy.Pipeline(cfg) as pipe:
        assert isinstance(pipe.executor.gpu, HostDevice)
        pipe.push(_boxes(path, [(0, 0), (4, 4), (8, 8), (12, 12)]))
        batch = pipe.pop()
        assert batch.info.device_type is damacy.DeviceType.CUDA and batch.info.ready_stream == 0
        n = len(log)
        batch.release(event=CupyStream(HANDLE))
        second = pipe.pop()
        waits = _waits_on_external(log, n)
        assert [log[n + i][1].ptr for i in waits] == [HANDLE]
        assert waits[0] < min(i for i, x in enumerate(log[n:]) if x[0] == "launch" and x[1] in ("assemble", "fill"))
        np.testing.assert_array_equal(second.copy(), np.stack([data[8:12, 8:12], data[12:16, 12:16]]).astype(np.float32))
        second.release()


@needs_twin
def test_a_release_event_that_is_no_event_is_a_type_error_and_keeps_the_batch(volume):
    path, data = volume
    gpu = LoggingGpu()
    with _pipe(gpu) as pipe:
        pipe.push(_boxes(path, [(0, 0), (4, 4)]))
        batch = pipe.pop()
        for junk in (object(), "0xE7E47", 1.5, True, CupyEvent("not an int")):
            with pytest.raises(TypeError, match="event must be a CUevent handle"):
                batch.release(event=junk)
        assert not _waits_on_external(gpu.log, 0) and not any(isinstance(e, ExternalEvent) for e in batch._array.sync._fences)
        np.testing.assert_array_equal(batch.copy(), np.stack([data[0:4, 0:4], data[4:8, 4:8]]).astype(np.float32))  # still held
        batch.release()


def test_a_cpu_batch_takes_no_release_event(volume):
    path, data = volume
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), prepared_batches=1)
    with damacy.Pipeline(cfg, embedded=True) as pipe:
        pipe.push(_boxes(path, [(0, 0), (4, 4), (8, 8), (12, 12)]))
        batch = pipe.pop()
        assert batch.info.device_type is damacy.DeviceType.CPU and batch.info.ready_stream == 0
        for event in (HANDLE, TorchEvent(HANDLE), CupyEvent(HANDLE)):
            with pytest.raises(damacy.InvalidArgument, match="CPU batch"):
                batch.release(event=event)
        with pytest.raises(TypeError):
            batch.release(event=object())
        np.testing.assert_array_equal(batch.numpy(), np.stack([data[0:4, 0:4], data[4:8, 4:8]]).astype(np.float32))  # still held
        batch.release(event=None)
        with pipe.pop() as second:  # its (only) slot was given back
            np.testing.assert_array_equal(second.numpy(), np.stack([data[8:12, 8:12], data[12:16, 12:16]]).astype(np.float32))


@needs_twin
def test_stream_arguments_follow_dlpack(volume):
    path, _ = volume
    gpu = LoggingGpu()
    with _pipe(gpu, slots=2) as pipe:
        pipe.push(_boxes(path, [(0, 0), (4, 4)] * 3))
        batch = pipe.pop()
        with pytest.raises(BufferError, match="stream 0 is ambiguous"):
            batch.__dlpack__(stream=0)
        n = len(gpu.log)
        unsynced = Consumer(batch, stream=-1)  # the consumer orders its own work
        assert not any(x[0] == "wait" and x[2] is not None for x in gpu.log[n:])
        default = Consumer(batch, stream=None, versioned=False)  # None: the legacy default stream
        assert [x[2] for x in gpu.log[n:] if x[0] == "wait" and x[2] is not None] == [1]
        unsynced.drop()
        default.drop()
        batch.release()
        # fenced where it was read only (records on None are the executor's, for later batches)
        assert [x[2] for x in gpu.log[n:] if x[0] == "record" and x[2] is not None] == [1]
        with pytest.raises(BufferError, match="cannot be exported to device"):
            pipe.pop().__dlpack__(dl_device=(dlpack.KDL_CPU, 0))


@needs_twin
def test_a_device_batch_is_not_a_numpy_array_but_copies_to_one(volume):
    path, data = volume
    with _pipe(LoggingGpu(), dtype="bf16") as pipe:
        pipe.push(_boxes(path, [(0, 0), (28, 28)]))
        with pipe.pop() as batch:
            assert batch.on_device
            with pytest.raises(BufferError, match="GPU memory.*from_dlpack"):
                batch.numpy()
            want = np.stack([data[0:4, 0:4], data[28:32, 28:32]]).astype(batch.numpy_dtype)
            got = np.asarray(batch)
            assert got.dtype == batch.numpy_dtype
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
            consumer = Consumer(batch, stream=5)
            assert (consumer.tensor.dtype.code, consumer.tensor.dtype.bits) == (dlpack.KDL_BFLOAT, 16)
            consumer.drop()


@needs_twin
def test_an_unconsumed_capsule_gives_its_use_back(volume):
    path, _ = volume
    with _pipe(LoggingGpu()) as pipe:
        pipe.push(_boxes(path, [(0, 0), (4, 4)] * 2))
        batch = pipe.pop()
        before = dlpack.outstanding()
        capsule = batch.__dlpack__(stream=3, max_version=(1, 0))
        assert dlpack.outstanding() == before + 1
        batch.release()
        assert not pipe.engine.free_slots()  # the capsule holds the slot
        del capsule
        assert dlpack.outstanding() == before
        pipe.pop(timeout=30).release()  # the slot was free again


@needs_twin
@pytest.mark.parametrize("on_error", ["fill", "skip"])
def test_error_policies_write_device_slots_in_stream_order(volume, tmp_path, on_error):
    path, data = volume
    gpu = LoggingGpu()
    missing = str(tmp_path / "nope.zarr")
    with _pipe(gpu, slots=2, on_error=on_error) as pipe:
        pipe.push([damacy.Sample(missing, ((0, 4), (0, 4))), *_boxes(path, [(0, 0), (8, 8)])])
        with pipe.pop() as batch:
            got = batch.copy()
            if on_error == "fill":
                assert [i for i, _ in batch.info.errors] == [0]
                np.testing.assert_array_equal(got[0], 0)
                np.testing.assert_array_equal(got[1], data[0:4, 0:4])
            else:  # the good sample moved up by a copy on the device (the input ran out: a short batch)
                assert [s.uri for s, _ in batch.info.skipped] == [missing] and ("copy",) in gpu.log
                np.testing.assert_array_equal(got, data[None, 0:4, 0:4])


@needs_twin
def test_a_prefetching_thread_hands_batches_to_the_training_stream(volume):
    """The training loop of the GPU quick start: a background thread pops the next batch and
    exports it on a copy stream while the main thread trains on the current one; each
    batch's slot is fenced on the stream that read it."""
    path, data = volume
    gpu = LoggingGpu()
    starts = [(4 * k, 4 * k) for k in range(8)]
    # slots: the step's batch, one handed over, one the thread holds waiting to hand it over
    with _pipe(gpu, slots=3) as pipe:
        pipe.push(_boxes(path, starts))
        handoff: list = []
        cond = threading.Condition()
        failures: list = []

        def prefetch() -> None:
            try:
                for _ in range(4):
                    batch = pipe.pop(timeout=60)
                    consumer = Consumer(batch, stream=9)  # exported on the copy stream
                    info = batch.info  # (a released batch has no info)
                    batch.release()  # the tensor keeps the slot
                    with cond:
                        cond.wait_for(lambda: not handoff, timeout=60)  # one batch ahead
                        handoff.append((info, consumer))
                        cond.notify_all()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                failures.append(e)
                with cond:
                    cond.notify_all()

        thread = threading.Thread(target=prefetch)
        thread.start()
        seen = []
        for _ in range(4):
            with cond:
                assert cond.wait_for(lambda: handoff or failures, timeout=60)
                assert not failures, failures
                info, consumer = handoff.pop(0)
                cond.notify_all()
            seen.append(info.batch_id)
            consumer.drop()  # the step is done with the tensor
        thread.join(60)
        assert seen == [0, 1, 2, 3] and not failures
        fences = [x[1] for x in gpu.log if x[0] == "record" and x[2] == 9]
        assert len(fences) == 4
        waited = {id(x[1]) for x in gpu.log if x[0] == "wait" and x[2] is None}
        assert id(fences[0]) in waited  # batch 0's slot was written again after the step let go


@pytest.mark.skipif(
    dlpack._dlpack is None,
    reason="without the C deleter (_dlpack.c, built with a C compiler) a deleter called with the consumer's error "
    "pending cannot run Python: the slot's use is not given back (see the README)",
)
def test_a_consumer_that_refuses_the_tensor_keeps_its_error_and_frees_the_slot(volume):
    """numpy takes no bfloat16 through DLPack: its error comes through intact (the capsule
    is dropped while it is pending) and the capsule's use of the slot ends."""
    path, _ = volume
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), dtype="bf16", prepared_batches=1)
    with damacy.Pipeline(cfg, embedded=True) as pipe:
        pipe.push(_boxes(path, [(0, 0), (4, 4)] * 2))
        batch = pipe.pop()
        before = dlpack.outstanding()
        with pytest.raises(Exception, match="(?i)dtype"):
            np.from_dlpack(batch)
        assert dlpack.outstanding() == before
        batch.release()
        pipe.pop(timeout=30).release()  # the slot was free again


def test_a_fence_that_cannot_be_recorded_still_frees_the_slot_and_odd_dtypes_take_nothing():
    from damacy_runtime.batch import Slot, _fenced_release
    from damacy_runtime.device import SlotSync

    freed = []
    slot = Slot(np.zeros(4, dtype=np.uint8), freed.append)
    slot.acquire()

    class Gone:
        def record_event(self, stream):
            raise RuntimeError("the context is gone")

    with pytest.raises(RuntimeError, match="context is gone"):
        _fenced_release(slot, Gone(), SlotSync(), 7)()
    assert freed == [slot]  # released all the same
    assert dlpack.dtype_of(np.dtype("complex64")) == (dlpack.KDL_COMPLEX, 64)
    with pytest.raises(BufferError, match="cannot describe"):
        dlpack.dtype_of(np.dtype([("a", "<i4")]))


@needs_twin
def test_a_config_naming_a_gpu_builds_the_gpu_pipeline(volume, monkeypatch):
    """The README's GPU quick start, shapes scaled down: Config(device=0) alone builds the
    CUDA executor and device slots (GPU 0 is the stand-in here); without CuPy the error says
    which extra to install."""
    from damacy_runtime import devices
    from damacy_runtime.devices import STANDIN_ENV
    from damacy_server import pipeline as pipeline_module

    path, data = volume
    monkeypatch.setenv(STANDIN_ENV, "1")
    plain = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), device=0)  # no GPU memory named: the default
    with damacy.Pipeline(plain) as pipe:
        assert isinstance(pipe.executor, CudaExecutor) and pipe.executor.budget.total == DEFAULT_GPU_MEMORY_BYTES
        assert pipe.device == 0 and pipe.executor.device == pipe.executor.device_index == 0
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), max_gpu_memory_bytes=1 << 26, dtype="bf16", device=0)
    with damacy.Pipeline(cfg) as pipe:
        assert isinstance(pipe.executor, CudaExecutor) and pipe.executor.budget.total == 1 << 26
        pipe.push(_boxes(path, [(0, 0), (4, 4)]))
        for batch in pipe.batches():
            with batch as t:
                want = np.stack([data[0:4, 0:4], data[4:8, 4:8]]).astype(batch.numpy_dtype)
                np.testing.assert_array_equal(t.numpy().view(np.uint16), want.view(np.uint16))

    def no_cupy(device):
        raise ModuleNotFoundError("No module named 'cupy'")

    monkeypatch.delenv(STANDIN_ENV)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (1, ""))  # a machine with GPU 0 ...
    monkeypatch.setattr(devices, "current_device", lambda: None)  # ... no context current
    monkeypatch.setattr("damacy_server.cuda.device.CupyDevice", no_cupy)
    with pytest.raises(damacy.InvalidArgument, match=r"needs CuPy and nvCOMP: pip install 'damacy\[cuda13\]'"):
        pipeline_module._components(cfg)
    with pytest.raises(damacy.InvalidArgument, match=r"needs CuPy and nvCOMP: pip install 'damacy\[cuda13\]'"):
        damacy.Pipeline(cfg)


def test_a_deleter_run_while_an_export_holds_the_registry_does_not_deadlock():
    # a garbage collection can run a consumer's deleter on the exporting thread, inside the
    # export's critical section: it must go through, not wait for itself
    def reentrant() -> None:
        with dlpack._lock:
            dlpack._delete(0)  # what the collection would run

    worker = threading.Thread(target=reentrant, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the deleter waited for the lock its own thread holds"


@needs_twin
def test_device_slot_memory_is_counted_gone_only_when_its_last_user_is_and_the_gpu_writes_it_where_it_is():
    """A device slot's bytes go back to the budget once the slot and every view of it are
    gone (not at close while a view is held); the GPU device's kernels write a device slot at
    its own address (the host stand-in shares this path but not CupyDevice's override)."""
    import gc

    from damacy_server.cuda.device import CupyDevice
    from damacy_server.engine.slots import DeviceSlots

    slots = DeviceSlots(HostDevice())
    slot = slots.allocate(0, 1 << 20)
    assert slots._gone == 0
    released = []
    view = slot.reshape((1024, 1024))
    slots.close(released.append)
    assert released == []  # still held
    gpu = object.__new__(CupyDevice)  # no GPU here: a device array's address needs none
    assert gpu.output_pointer(view) == view.ptr
    del slot, view
    gc.collect()
    assert released == [1 << 20]


@needs_twin
def test_slot_memory_goes_back_to_the_allocator_only_after_the_consumers_fences():
    """A slot's last view gone, the fences its consumers left (their kernels reading the last
    batch) are waited for before the memory is freed: the allocator may hand it to a buffer
    the executor's stream writes at once."""
    import gc

    waited = []

    class Fenced(HostDevice):
        def synchronize_event(self, event):
            waited.append(event)

    device = Fenced()
    slot = device.array(4096)
    view = slot[16:32]
    slot.sync.add_fence("consumer A")
    slot.sync.add_fence("consumer B")
    del slot
    gc.collect()
    assert waited == []  # a view still holds the memory
    del view
    gc.collect()
    assert waited == ["consumer A", "consumer B"]
