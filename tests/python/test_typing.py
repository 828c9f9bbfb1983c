"""The package is typed for its users' checkers (IDEs, mypy, pyright): py.typed and the extension's stub
(``_devbridge.pyi``, generated from the built module by nanobind's stubgen) are installed, and code written
as the README writes it checks clean while a misuse is caught."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

import devbridge
from test_examples import readme_python_blocks

PACKAGE = pathlib.Path(devbridge.__file__).parent


def test_the_package_is_marked_typed_and_the_extension_has_its_stub():
    assert (PACKAGE / "py.typed").is_file()
    stub = ast.parse((PACKAGE / "_devbridge.pyi").read_text())
    classes = {node.name for node in stub.body if isinstance(node, ast.ClassDef)}
    assert {"Bridge", "DeviceHandle", "ObjectSpec", "HostRing", "TensorView", "TransferPlanner"} <= classes
    # `with Bridge() as b` is the caller's subclass (with upload, checkpoint, ...), not the extension's base.
    enter = [f for c in stub.body if isinstance(c, ast.ClassDef) and c.name == "Bridge"
             for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__enter__"]
    assert enter and ast.unparse(enter[0].returns) == "Self"


def run_mypy(tmp_path: pathlib.Path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "client.py"
    script.write_text(source)
    # The installed package, as a user's checker sees it; a fresh cache, so the run depends on nothing left.
    return subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull,
                           str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)


needs_mypy = pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                reason="mypy is not installed (requirements-dev.txt installs it)")


@needs_mypy
def test_the_readme_python_examples_type_check(tmp_path):
    done = run_mypy(tmp_path, "\n".join(readme_python_blocks()))
    assert done.returncode == 0, done.stdout + done.stderr


@needs_mypy
def test_the_example_programs_type_check():
    examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull,
                           *sorted(str(p) for p in examples.glob("*.py"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_mypy
def test_a_checker_catches_a_misuse(tmp_path):
    done = run_mypy(tmp_path, "import devbridge\n"
                              "with devbridge.Bridge() as bridge:\n"
                              "    bridge.free('not a handle')\n"
                              "    bridge.no_such_method()\n"
                              "    n: str = bridge.ring.capacity\n")
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'client.py:3: error: Argument 1 to "free" of "Bridge" has incompatible type "str"' in done.stdout
    assert 'client.py:4: error: "Bridge" has no attribute "no_such_method"' in done.stdout
    assert "client.py:5: error: Incompatible types in assignment" in done.stdout
