"""The shape of the code holds: the import contracts (layers, no cycles at any depth), ruff,
mypy on the typed packages, and a reason at the top of every module over 400 lines.

Each runs the tool as a developer would, from the repository root, with the settings in
pyproject.toml; a failure prints what the tool printed."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import damacy

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("damacy", "damacy_protocol", "damacy_runtime", "damacy_server", "damacy_client")


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which(tool, path=os.path.dirname(sys.executable)) or shutil.which(tool)
    assert exe, f"{tool} is not installed (pip install -e '.[test]' brings it)"
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_imports_keep_the_layers_and_have_no_cycles():
    done = _run("lint-imports", "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_ruff_finds_nothing():
    done = _run("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing_in_the_typed_packages():
    done = _run("mypy")  # the packages in pyproject.toml's [tool.mypy]
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_module_over_400_lines_says_why_it_is_one_job():
    long = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if text.count("\n") > 400:
                doc = ast.get_docstring(ast.parse(text)) or ""
                if not re.search(r"\(Over 400 lines: one job, [^)]+\)", doc):
                    long.append(str(path.relative_to(ROOT)))
    assert not long, f"over 400 lines without '(Over 400 lines: one job, ...)' in the docstring: {long}"


def test_every_lazy_name_of_the_face_is_named_for_the_checkers_too():
    """damacy loads most of its API on first use (by name, which import analysis cannot
    see): the TYPE_CHECKING block names the same objects, so the contracts above see every
    edge; and every name resolves."""
    tree = ast.parse((ROOT / "damacy" / "__init__.py").read_text())
    checked: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                for alias in imp.names:
                    checked[alias.asname or alias.name] = f"{imp.module}.{alias.name}"
    lazy = {
        name: ".".join(where) if isinstance(where, tuple) else f"{where}.{name}" for name, where in damacy._LAZY.items()
    }
    assert checked == lazy
    for name in lazy:
        assert getattr(damacy, name) is not None


@pytest.mark.parametrize("package", ["damacy_protocol"])
def test_the_protocol_does_no_io(package):
    """The wire contract imports no socket, file-system or device library (h11's rule: the
    protocol is states and bytes)."""
    banned = {"zmq", "ctypes", "socket", "subprocess", "shutil", "mmap", "obstore"}
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in banned]
    assert not found, found
