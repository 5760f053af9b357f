"""The README's quick start runs as written, with a real array in place of its path."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import random_data, write_array
from zarr.codecs import ZstdCodec

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart() -> str:
    text = README.read_text()
    m = re.search(r"<!-- quickstart:.*?-->\s*```python\n(.*?)```", text, re.S)
    assert m, "the README has no quick start block"
    return m.group(1)


def test_quickstart_runs(tmp_path, capsys):
    write_array(tmp_path / "volume.zarr", random_data((96, 128, 128), "uint16", 0), chunks=(32, 64, 64), compressors=[ZstdCodec()])
    code = quickstart()
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
