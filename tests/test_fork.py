"""A pipeline made before a fork: the child is told at once what to do, never hangs, and
closing the child's copy leaves the parent's pipeline working."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy

from conftest import random_data, write_array


def _child(pipe, results) -> None:
    out = []
    for name, args in (("pop", (5,)), ("push", ([],)), ("stats", ())):
        try:
            getattr(pipe, name)(*args)
            out.append("no error")
        except damacy.DamacyError as e:
            out.append(str(e))
    pipe.close()  # the child's copy: must not touch the parent's session or threads
    del pipe
    results.put(out)


@pytest.mark.parametrize("mode", ["embedded", "daemon"])
def test_a_forked_child_is_told_at_once_and_the_parent_goes_on(tmp_path, mode, request):
    data = random_data((40, 30), "uint16", seed=4)
    write_array(tmp_path / "f.zarr", data, chunks=(10, 10), compressors=[ZstdCodec()])
    uri = str(tmp_path / "f.zarr")
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(10, 10), dtype="u16")
    endpoint = request.getfixturevalue("daemon").endpoint if mode == "daemon" else None
    boxes = [np.s_[i : i + 10, 0:10] for i in range(0, 30, 5)]
    with damacy.Pipeline(cfg, endpoint=endpoint) if endpoint else damacy.Pipeline(cfg) as pipe:
        pipe.push(damacy.Sample(uri, b) for b in boxes)
        first = np.array(np.from_dlpack(pipe.pop()))
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_child, args=(pipe, results))
        child.start()
        said = results.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0
        assert len(said) == 3 and all("a fork of it" in s and "Make the pipeline in the process that uses it" in s for s in said), said
        rest = [np.array(np.from_dlpack(b)) for b in pipe]  # the parent's pipeline still works
    got = np.concatenate([first, *rest])
    for k, box in enumerate(boxes):
        np.testing.assert_array_equal(got[k], data[box])
