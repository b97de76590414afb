"""The code base stays ruff-clean (lint and format), checked in CI with the tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(args: list[str]) -> None:
    proc = subprocess.run(
        ["ruff", *args, *(d for d in ("fp4gen", "tests", "benchmarks") if (ROOT / d).is_dir())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
