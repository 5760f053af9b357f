"""damacy.torch.Loader: tensors over epochs of a sampler, in and out of a DataLoader, with
checkpoints; and batches handed to JAX through DLPack."""

from __future__ import annotations

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy

from conftest import random_data, write_array

torch = pytest.importorskip("torch")


@pytest.fixture
def volume(tmp_path):
    data = random_data((40, 48, 36), "uint16", seed=6)
    write_array(tmp_path / "v.zarr", data, chunks=(10, 16, 12), compressors=[ZstdCodec()])
    return str(tmp_path / "v.zarr"), data


def _box(s):
    return tuple(slice(sl.start, sl.stop) for sl in s.selection)


def _loader(uri, **kw):
    from damacy.torch import Loader

    sampler = damacy.RandomBoxes([uri], (8, 16, 12), seed=2, samples_per_epoch=22, rank=0, world_size=1)
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(8, 16, 12), dtype="f32", drop_last=False)  # 22 samples: a short last batch
    return Loader(cfg, sampler, **kw), sampler


def test_tensors_over_epochs_equal_the_arrays(volume):
    uri, data = volume
    loader, sampler = _loader(uri, with_info=True)
    assert len(loader) == 6
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        got = [(x.clone(), info) for x, info in loader]
        assert len(got) == 6 and sum(len(x) for x, _ in got) == 22
        for x, info in got:
            assert isinstance(x, torch.Tensor) and x.dtype == torch.float32
            for k, s in enumerate(info.samples):
                np.testing.assert_array_equal(x[k].numpy(), data[_box(s)].astype("f4"))
        epochs.append([info.samples for _, info in got])
    assert epochs[0] != epochs[1]  # a new draw each epoch
    loader.close()


def test_a_dataloader_with_no_workers_and_one_forked_worker(volume):
    uri, data = volume
    loader, _ = _loader(uri)
    plain = [x.clone() for x in loader]
    loader.close()
    for workers in (0, 1):  # one worker: a forked process makes its own pipeline on first use
        fresh, _ = _loader(uri)
        kw = {"multiprocessing_context": "fork"} if workers else {}
        got = [x.clone() for x in torch.utils.data.DataLoader(fresh, batch_size=None, num_workers=workers, **kw)]  # a tensor holds its slot: keep copies
        assert len(got) == len(plain) and all(torch.equal(a, b) for a, b in zip(got, plain))
    two, _ = _loader(uri)
    with pytest.raises(Exception, match="num_workers=0"):
        list(torch.utils.data.DataLoader(two, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    # a loader read here first, then by a forked worker: the worker makes its own pipeline
    # (the parent's, inherited, belongs to this process)
    again, _ = _loader(uri)
    assert all(torch.equal(a, b) for a, b in zip([x.clone() for x in again], plain))
    got = [x.clone() for x in torch.utils.data.DataLoader(again, batch_size=None, num_workers=1, multiprocessing_context="fork")]
    assert len(got) == len(plain) and all(torch.equal(a, b) for a, b in zip(got, plain))
    assert sum(1 for _ in again) == len(plain)  # and this process's still reads
    again.close()


def test_the_length_of_an_epoch_drops_the_short_batch_with_drop_last(volume):
    import damacy.torch

    uri, _ = volume
    for drop in (False, True):
        cfg = damacy.Config(samples_per_batch=4, sample_shape=(4, 6, 5), drop_last=drop)
        loader = damacy.torch.Loader(cfg, damacy.RandomBoxes([uri], (4, 6, 5), seed=0, samples_per_epoch=10))
        assert len(loader) == sum(1 for _ in loader) == (2 if drop else 3)
        loader.close()


def test_a_checkpoint_mid_epoch_goes_on_batch_for_batch(volume):
    uri, _ = volume
    loader, _ = _loader(uri)
    loader.set_epoch(1)
    whole, state = [], None
    for k, x in enumerate(loader):
        whole.append(x.clone())
        if k == 2:
            state = loader.state_dict()
    loader.close()
    assert state["epoch"] == 1 and state["pipeline"]["offset"] == 12
    again, sampler = _loader(uri)
    again.load_state_dict(state)
    rest = [x.clone() for x in again]
    assert sampler.epoch == 1 and len(rest) == len(whole) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[3:]))
    again.close()


def test_jax_takes_batches_through_dlpack(volume):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    uri, data = volume
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 16, 12), dtype="f32")
    with damacy.Pipeline(cfg) as pipe:
        pipe.push([damacy.Sample(uri, np.s_[0:8, 0:16, 0:12]), damacy.Sample(uri, np.s_[30:38, 32:48, 24:36])])
        with pipe.pop() as batch:
            x = jnp.from_dlpack(batch)
            assert x.shape == (2, 8, 16, 12) and x.dtype == jnp.float32
            total = float(jax.jit(jnp.sum)(x))
            np.testing.assert_array_equal(np.asarray(x[1]), data[30:38, 32:48, 24:36].astype("f4"))
            del x
    assert total == pytest.approx(float(data[0:8, 0:16, 0:12].astype("f8").sum() + data[30:38, 32:48, 24:36].astype("f8").sum()), rel=1e-6)


def test_the_datamodule_example_trains_validates_and_resumes(volume):
    import importlib.util
    from pathlib import Path

    uri, data = volume
    spec = importlib.util.spec_from_file_location("datamodule", Path(__file__).resolve().parents[1] / "examples" / "datamodule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dm = module.ZarrDataModule([uri], [uri], (8, 16, 12), batch=4, samples_per_epoch=20)
    dm.setup("fit")
    train = dm.train_dataloader()
    seen = []
    for k, x in enumerate(train):
        seen.append(x.clone())
        if k == 1:
            state = dm.state_dict()
    voxels = 0
    for x, info in dm.val_dataloader():
        keep = [k for k in range(len(info.samples)) if k not in info.padding]
        for k in keep:
            np.testing.assert_array_equal(x[k].numpy(), data[_box(info.samples[k])].astype("f4"))
        voxels += len(keep)
    assert voxels == 5 * 3 * 3  # the grid's windows over 40 x 48 x 36
    dm.teardown()
    again = module.ZarrDataModule([uri], [uri], (8, 16, 12), batch=4, samples_per_epoch=20)
    again.setup("fit")
    again.load_state_dict(state)
    rest = [x.clone() for x in again.train_dataloader()]
    assert len(rest) == 3 and all(torch.equal(a, b) for a, b in zip(rest, seen[2:]))
    again.teardown()


def test_the_readme_example_runs(tmp_path):
    from test_readme import block

    write_array(tmp_path / "a.zarr", random_data((64, 96, 80), "uint16", seed=3), chunks=(32, 32, 32), compressors=[ZstdCodec()])
    scope: dict = {}
    exec(compile(block("torch").replace('"data/', f'"{tmp_path}/'), "README torch", "exec"), scope)
    assert scope["x"].shape == (4, 32, 64, 64) and scope["state"]["epoch"] == 1
    assert scope["state"]["pipeline"]["offset"] == 64


def test_a_checkpoint_after_set_epoch_starts_that_epoch_whole(volume):
    uri, _ = volume
    loader, _ = _loader(uri)
    loader.set_epoch(0)
    first = [x.clone() for x in loader]
    loader.set_epoch(1)
    state = loader.state_dict()  # taken between epochs, after moving on
    loader.close()
    again, _ = _loader(uri)
    again.load_state_dict(state)
    assert again.state_dict()["epoch"] == 1
    assert sum(1 for _ in again) == len(first)  # epoch 1 whole, not skipped
    again.close()


def test_a_checkpoint_after_set_epoch_starts_that_epoch_whole_for_a_plain_list(volume):
    """A list has no epoch of its own to tell the saved position's epoch by: the loader does."""
    from damacy.torch import Loader

    uri, _ = volume
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(8, 16, 12), dtype="f32")
    samples = [damacy.Sample(uri, np.s_[z : z + 8, 0:16, 0:12]) for z in range(0, 32, 4)]
    loader = Loader(cfg, samples)
    loader.set_epoch(0)
    first = [x.clone() for x in loader]
    loader.set_epoch(1)
    state = loader.state_dict()
    loader.close()
    assert state == {"epoch": 1, "pipeline": None}
    again = Loader(cfg, samples)
    again.load_state_dict(state)
    rest = [x.clone() for x in again]
    assert len(rest) == len(first) == 2 and all(torch.equal(a, b) for a, b in zip(rest, first))
    again.close()


def test_the_loader_holds_no_slot_of_a_tensor_it_handed_out(volume):
    """With one slot, the next batch can be made once the caller lets its tensor go."""
    import gc

    from damacy.torch import Loader

    uri, data = volume
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 16, 12), dtype="f32", prepared_batches=1, pop_timeout_s=60)
    loader = Loader(cfg, [damacy.Sample(uri, np.s_[z : z + 8, 0:16, 0:12]) for z in range(0, 32, 8)])
    got = []
    for x in loader:
        got.append(x.clone())
        del x
        gc.collect()
    assert len(got) == 2 and np.array_equal(got[1][1].numpy(), data[24:32, 0:16, 0:12].astype("f4"))
    loader.close()


def test_a_loader_pickles_after_it_was_read_and_its_copy_reads_on_its_own(volume):
    import pickle

    uri, _ = volume
    loader, _ = _loader(uri)
    plain = [x.clone() for x in loader]
    copy = pickle.loads(pickle.dumps(loader))  # what a spawned DataLoader worker gets
    assert copy._pipe is None
    assert all(torch.equal(a, b) for a, b in zip([x.clone() for x in copy], plain))
    assert sum(1 for _ in loader) == len(plain)  # and the original still reads
    copy.close()
    loader.close()
