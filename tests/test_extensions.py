"""The compiled extensions are optional in fact: damacy imports, reads and streams without
them (an install without a C compiler), and where a compiler was present they were built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

from damacy_runtime.extensions import optional

from conftest import random_data, write_array

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = ("damacy_server.native._assemble", "damacy_server.cuda._twin", "damacy_runtime._dlpack")
#: set where damacy was installed without a C compiler on purpose (.ci/run's second install)
WITHOUT_CC = "DAMACY_BUILT_WITHOUT_CC"


@pytest.mark.skipif(bool(os.environ.get(WITHOUT_CC)), reason=f"{WITHOUT_CC} is set: this install has no extensions on purpose")
def test_every_extension_was_built():
    """The build skips an extension it cannot compile without failing the install: this is
    where a build that broke says so (set DAMACY_BUILT_WITHOUT_CC=1 for an install without a
    C compiler)."""
    missing = [name for name in EXTENSIONS if optional(name) is None]
    assert not missing, f"not built: {missing} (is a C compiler installed? pip install -e . builds them)"


def test_optional_tells_a_module_not_built_from_a_broken_one(tmp_path, monkeypatch):
    package = tmp_path / "somepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_broken.py").write_text("import somepkg_dependency_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert optional("somepkg._not_built") is None
    with pytest.raises(ModuleNotFoundError, match="somepkg_dependency_that_is_not_there"):
        optional("somepkg._broken")


SCRIPT = r"""
import sys
# the editable install of the built tree (the test's venv) would fill in the modules the copy lacks
sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", type(f).__name__)]
import numpy as np
from damacy_runtime.extensions import optional
import damacy, damacy_server, damacy_runtime.dlpack as dlpack
from damacy_server import native
from damacy_server.cuda import twin

assert damacy_server.__file__.startswith(sys.argv[1]), damacy_server.__file__  # the copy, not the build
assert [optional(n) for n in sys.argv[3:]] == [None] * len(sys.argv[3:])
assert not native.available() and not twin.available() and dlpack._dlpack is None
uri = sys.argv[2]
want = np.load(uri + ".npy")
assert np.array_equal(damacy.read(uri, np.s_[3:40, 5:60, 0:33], dtype="f32"), want[3:40, 5:60, 0:33].astype("f4"))
cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 16, 16), dtype="f32")
with damacy.Pipeline(cfg, embedded=True) as pipe:
    pipe.push(damacy.Sample(uri, np.s_[z : z + 8, 4:20, 10:26]) for z in range(6))
    for k, batch in enumerate(pipe.batches()):
        with batch:
            x = np.from_dlpack(batch)  # DLPack with the ctypes deleter
            for j in range(2):
                z = 2 * k + j
                assert np.array_equal(x[j], want[z : z + 8, 4:20, 10:26].astype("f4")), (k, j)
            del x
assert k == 2
print("ok")
"""


def test_damacy_reads_and_streams_from_a_tree_without_the_extensions(tmp_path):
    """The source tree as a clone has it (no compiled files): imports, one-call reads, a
    pipeline and DLPack export all run on numpy alone."""
    tree = tmp_path / "tree"
    for package in ("damacy", "damacy_protocol", "damacy_runtime", "damacy_server", "damacy_client"):
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    data = random_data((40, 70, 33), "uint16", 4)
    uri = str(tmp_path / "v.zarr")
    write_array(uri, data, chunks=(16, 32, 16), compressors=[ZstdCodec()])
    np.save(uri + ".npy", data)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tree), uri, *EXTENSIONS], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
