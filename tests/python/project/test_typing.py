"""The stubs are the compiled module's own (make stubs), and the README's examples
run. That a type checker accepts the examples against the stubs (issue 18 §4,
`mypy --strict`) is the lint lane's (make lint), with the package's own check."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "tests" / "typing" / "readme_examples.py"
STUBS = ROOT / "python" / "tensorwire" / "_core.pyi"
PATTERNS = ROOT / "python" / "bindings" / "stubgen_patterns.txt"


def test_stubs_match_the_compiled_module(tmp_path):
    pytest.importorskip("nanobind")
    out = tmp_path / "_core.pyi"
    run = subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-m", "tensorwire._core", "-p", str(PATTERNS), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr

    # The declarations, not the docstrings' layout (which may move between nanobind versions).
    def declarations(text: str) -> list[str]:
        return [line.strip() for line in text.splitlines() if line.strip().startswith(("def ", "class "))]

    assert declarations(out.read_text()) == declarations(STUBS.read_text()), (
        "python/tensorwire/_core.pyi is stale: run `make stubs`"
    )


def test_readme_examples_run():
    run = subprocess.run([sys.executable, str(EXAMPLES)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
