"""The README's examples run as written, with a real array in place of its path."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

from conftest import random_data, write_array

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = sorted((README.parent / "docs").glob("*.md"))


def _blocks() -> dict[str, str]:
    """Every named python block of the README and the guides (docs/): the comment before it
    says which test runs it."""
    found: dict[str, str] = {}
    for page in [README, *DOCS]:
        for m in re.finditer(r"<!-- (\w+):.*?-->\s*```python\n(.*?)```", page.read_text(), re.S):
            assert m.group(1) not in found, f"two blocks named {m.group(1)}"
            found[m.group(1)] = m.group(2)
    return found


def block(name: str) -> str:
    found = _blocks()
    assert name in found, f"neither the README nor docs/ has a {name} block"
    return found[name]


def test_every_python_block_of_the_readme_and_the_guides_is_named_for_a_test():
    """An unnamed block would be run by nothing: each names the test that runs it."""
    for page in [README, *DOCS]:
        text = page.read_text()
        for m in re.finditer(r"```python\n", text):
            before = text[: m.start()].rstrip().splitlines()[-1]
            assert re.match(r"<!-- \w+: .*tests/test_\w+\.py", before), f"{page.name}: a python block no test names: {text[m.end():m.end() + 80]!r}"
    named = set(_blocks())
    tests = "\n".join(p.read_text() for p in README.parent.glob("tests/test_*.py"))
    for name in named:
        assert re.search(rf"block\(\s*\"{name}\"", tests), f"no test runs the {name} block"


def test_quickstart_runs(tmp_path, capsys):
    write_array(tmp_path / "volume.zarr", random_data((96, 128, 128), "uint16", 0), chunks=(32, 64, 64), compressors=[ZstdCodec()])
    code = block("quickstart")
    assert '"data/volume.zarr"' in code
    exec(compile(code.replace("data/volume.zarr", str(tmp_path / "volume.zarr")), "README quick start", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 10 and lines[0].startswith("0 (4, 32, 64, 64) float32")


def test_ci_runs_the_readmes_test_command_exactly():
    block = re.search(r"## Two commands\s*```bash\n(.*?)```", README.read_text(), re.S)
    assert block, "the README has no two commands"
    install_and_demo, install_and_test = [line.split("#")[0].strip() for line in block.group(1).strip().splitlines()]
    assert install_and_demo.endswith("damacy demo")
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert install_and_test in ci


def test_one_call_reads_run(tmp_path):
    import numpy as np

    data = random_data((96, 128, 128), "uint16", 0)
    write_array(tmp_path / "volume.zarr", data, chunks=(32, 64, 64), compressors=[ZstdCodec()])
    code = "import numpy as np\nimport damacy\n" + block("reads").replace("data/volume.zarr", str(tmp_path / "volume.zarr"))
    scope: dict = {}
    exec(compile(code, "README one-call reads", "exec"), scope)
    assert np.array_equal(scope["x"], data[0:64, 0:128, 0:128].astype("f4"))
    assert np.array_equal(scope["plane"], data[10])
    assert np.array_equal(scope["edge"][8:], data[0:24, 0:64, 0:64]) and not scope["edge"][:8].any()
    assert np.array_equal(scope["y"], data[[5, 2, 2, 95], 0:100])
    assert scope["meta"].shape == data.shape


def test_composed_pipeline_runs(tmp_path):
    import numpy as np

    import damacy

    data = random_data((96, 128, 128), "uint16", 1)
    write_array(tmp_path / "volume.zarr", data, chunks=(32, 64, 64), compressors=[ZstdCodec()])
    scope: dict = {"damacy": damacy}
    exec(compile(block("composed"), "README composed pipeline", "exec"), scope)
    uri = str(tmp_path / "volume.zarr")
    with scope["pipe"] as pipe:
        pipe.push(damacy.Sample(uri, np.s_[z : z + 32, 8:72, 60:124]) for z in range(8))
        for k, batch in enumerate(pipe.batches()):
            with batch:
                for j in range(4):
                    z = 4 * k + j
                    assert np.array_equal(batch.numpy()[j], data[z : z + 32, 8:72, 60:124].astype("f4"))
        assert k == 1


def test_image_reads_run(tmp_path):
    from test_ngff import pyramid

    uri, data = pyramid(tmp_path / "image.zarr", 3, size=256, chunks=(1, 4, 32, 32))  # reads cut several chunks
    scope: dict = {}
    code = "import numpy as np\nimport damacy\n" + block("images").replace("data/image.zarr", uri)
    exec(compile(code, "README images", "exec"), scope)
    assert np.array_equal(scope["low"], data[2][0, :, 0:64, 0:64])
    assert np.array_equal(scope["near"], data[1][0, :, 0:64, 0:64])
    assert scope["sample"].uri == uri and scope["sample"].level == 1


def _volume(path, seed):
    data = random_data((64, 256, 256), "uint16", seed)
    write_array(path, data, chunks=(32, 128, 128), compressors=[ZstdCodec()])
    return str(path), data


def _bf16(values):
    import ml_dtypes

    return values.astype(np.float32).astype(ml_dtypes.bfloat16)


def test_the_daemon_block_runs_through_a_damacyd(tmp_path, daemon, monkeypatch):
    import torch

    import damacy
    from damacy_client.client import RemotePipeline

    uri, data = _volume(tmp_path / "v.zarr", 7)
    monkeypatch.setenv("DAMACY_ENDPOINT", daemon.endpoint)  # as a node's damacyd answers
    got = []

    def my_samples(rank):
        return [damacy.Sample(uri, np.s_[:, :, :]) for _ in range(16)]

    scope = {"damacy": damacy, "torch": torch, "my_samples": my_samples, "rank": 0}
    exec(compile(block("daemon") + "\n    got.append((type(pipe), x.shape))", "docs daemon", "exec"), {**scope, "got": got})
    assert got == [(RemotePipeline, torch.Size([8, 64, 256, 256]))]


def test_the_gpu_block_runs_on_a_gpu_or_the_stand_in(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import damacy
    from damacy_runtime.devices import STANDIN_ENV, cuda_devices
    from damacy_server.cuda import twin

    if cuda_devices()[0] == 0:
        if not twin.available():
            pytest.skip("no GPU, and the host twin that stands in for one was not built (no C compiler)")
        monkeypatch.setenv(STANDIN_ENV, "1")
    uri, data = _volume(tmp_path / "v.zarr", 8)
    samples = [damacy.Sample(uri, np.s_[:, :, :]) for _ in range(16)]
    losses = []

    def step(x):
        losses.append(x.float().sum().item())
        return losses[-1]

    scope = {"damacy": damacy, "torch": torch, "samples": samples, "step": step}
    exec(compile(block("gpu"), "docs gpu", "exec"), scope)
    assert len(losses) == 2 and losses[0] == pytest.approx(float(_bf16(data).astype(np.float64).sum()) * 8, rel=1e-6)



def test_the_guides_name_every_damacyd_option_and_config_field():
    """The daemon guide's table lists every option damacyd takes, and the pipeline guide's
    every Config field: a flag or field added without its line fails here."""
    import dataclasses

    from damacy_protocol.config import Config
    from damacy_server.daemon.cli import main

    daemon = (README.parent / "docs" / "daemon.md").read_text()
    flags = [opt for p in main.params for opt in p.opts if opt.startswith("--") and opt not in ("--help", "--version")]
    missing = [f for f in flags if f"`{f}" not in daemon]
    assert not missing, f"docs/daemon.md does not describe {missing}"
    pipeline = (README.parent / "docs" / "pipeline.md").read_text()
    fields = [f.name for f in dataclasses.fields(Config) if f"`{f.name}`" not in pipeline]
    assert not fields, f"docs/pipeline.md does not describe Config's {fields}"
