"""The examples run, briefly, as a user would run them (a fresh interpreter, from the repository root)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """examples/<name> with ``args``, from the repository root, in a fresh interpreter. The examples set
    tinygrad's default device themselves; one inherited from this process (tinygrad writes DEV into the
    environment once it has picked a default) would only add a warning."""
    env = {k: v for k, v in os.environ.items() if k != "DEV"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                    reason="scikit-learn is not installed (requirements-dev.txt installs it)")
@pytest.mark.skipif(importlib.util.find_spec("tinygrad") is None, reason="tinygrad is not installed")
# TinyJit at depth 1: its capture call keeps that batch for as long as the jitted step lives, so one of
# the two slots is pinned for good; the Prefetcher retires it (it used to stall, then raise). Without the
# jit, the default depth.
@pytest.mark.parametrize("jit, depth", [(True, 1), (False, 2)], ids=["jit-depth1", "no-jit"])
def test_train_digits_is_bit_exact_against_numpy_feeding(jit, depth):
    done = run_example("train_digits.py", "--epochs", "1", "--backend", "host", "--depth", str(depth),
                       *([] if jit else ["--no-jit"]), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bit-exact" in done.stdout and "Prefetcher epoch 1" in done.stdout and "numpy epoch 1" in done.stdout


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                    reason="scikit-learn is not installed (requirements-dev.txt installs it)")
@pytest.mark.skipif(importlib.util.find_spec("tinygrad") is None, reason="tinygrad is not installed")
def test_train_digits_takes_one_step_and_refuses_a_batch_past_the_data():
    # One step: the loss before it is the only one to compare (it said MISMATCH). A batch larger than the
    # data: exit 2 saying so (an IndexError).
    base = ("train_digits.py", "--epochs", "1", "--backend", "host", "--no-jit")
    done = run_example(*base, "--batch", "1000", timeout=600)
    assert done.returncode == 0 and "bit-exact" in done.stdout, done.stdout + done.stderr
    done = run_example(*base, "--batch", "100000", timeout=60)
    assert done.returncode == 2 and "more than the 1797 images" in done.stderr, done.stdout + done.stderr


@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="Ray is not installed (pip install 'devbridge[ray]'; requirements-dev.txt installs it)")
@pytest.mark.skipif(importlib.util.find_spec("tinygrad") is None, reason="tinygrad is not installed")
def test_ray_pipeline_survives_a_killed_worker_bit_exact():
    done = run_example("ray_pipeline.py", "--batches", "6", "--kill-at", "3", "--batch-size", "64", "--num-cpus",
                       "2", "--timeout", "60", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bit-exact" in done.stdout and "worker B restarts: 1" in done.stdout


def readme_python_blocks() -> list[str]:
    """The README's ```python blocks, in order: the second continues the first (its imports)."""
    text = (ROOT / "README.md").read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


@pytest.mark.skipif(importlib.util.find_spec("tinygrad") is None, reason="tinygrad is not installed")
def test_the_readme_python_examples_run_as_written():
    # Pasted one after the other into a fresh interpreter, as a user copying them would, with tinygrad on
    # CPU as the README says: every print says True or matches, and nothing warns.
    blocks = readme_python_blocks()
    assert len(blocks) >= 2, "the README lost its Python examples"
    script = "import warnings\nwarnings.simplefilter('error')\n" + "\n".join(blocks)
    env = {**{k: v for k, v in os.environ.items() if k != "DEV"}, "DEV": "CPU"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.split()
    assert "False" not in lines and lines.count("True") == 3, done.stdout
