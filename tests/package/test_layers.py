"""The package's layers (docs/architecture.md) hold: nothing imports upward.

The contracts are in pyproject.toml (``[tool.importlinter]``) and checked with
import-linter, which reads every import statement of every module, including lazy
imports inside functions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_import_layers_are_kept() -> None:
    pytest.importorskip("importlinter", reason="pip install import-linter (the dev extra)")
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_the_layer_contract_names_every_top_level_module() -> None:
    """A new top-level module must be placed in a layer, or the contract cannot see it."""
    tomllib = pytest.importorskip("tomllib")

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layers = config["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {part.strip() for layer in layers for part in layer.replace(":", "|").split("|")}
    package = ROOT / "slurm_elastic"
    modules = {
        p.stem if p.is_file() else p.name
        for p in package.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert modules == named, f"not in a layer: {modules - named}; gone: {named - modules}"
