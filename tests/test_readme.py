"""The README's examples run as written, with a real array in place of its path."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from zarr.codecs import ZstdCodec

from conftest import random_data, write_array

README = Path(__file__).resolve().parents[1] / "README.md"


def block(name: str) -> str:
    text = README.read_text()
    m = re.search(rf"<!-- {name}:.*?-->\s*```python\n(.*?)```", text, re.S)
    assert m, f"the README has no {name} block"
    return m.group(1)


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

    uri, data = pyramid(tmp_path / "image.zarr", 3, size=256)
    scope: dict = {}
    code = "import numpy as np\nimport damacy\n" + block("images").replace("data/image.zarr", uri)
    exec(compile(code, "README images", "exec"), scope)
    assert np.array_equal(scope["low"], data[2][0, :, 0:64, 0:64])
    assert np.array_equal(scope["near"], data[1][0, :, 0:64, 0:64])
    assert scope["sample"].uri == uri and scope["sample"].level == 1
