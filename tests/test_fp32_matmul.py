"""fp4gen.runtime.fp32_matmul: the exact fp32 GEMM paths turn TF32 off for their block whatever
TF32 setting the process has, and put the setting back.

Each case runs in a fresh process: a TF32 setting is process-wide, and setting torch's
all-backends ``fp32_precision`` here would reach every later test in this process (under
pytest-xdist, a worker's arbitrary subset). With that setting made first (as transformers'
Trainer makes it with ``torch_compile=True`` on a CUDA machine), reading the legacy
``allow_tf32`` flag raises RuntimeError, and the dequant backend's torch decode did so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import fp4gen
    from fp4gen.numerics import quantize
    from fp4gen.runtime.fp32_matmul import ieee_fp32_matmul

    setting = sys.argv[1]
    if setting == "all_backends_tf32":
        torch.backends.fp32_precision = "tf32"
    elif setting == "legacy_allow_tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif setting == "matmul_precision_high":
        torch.set_float32_matmul_precision("high")
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    with ieee_fp32_matmul():
        inside = matmul.fp32_precision
    g = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(8, 64, generator=g), "nvfp4")
    b = quantize(torch.randn(12, 64, generator=g), "nvfp4")
    c = fp4gen.gemm(a, b, backend="dequant")  # the CPU's torch decode: an fp32 GEMM
    legacy = None if setting == "all_backends_tf32" else matmul.allow_tf32
    print(json.dumps({"before": before, "inside": inside, "after": matmul.fp32_precision,
                      "legacy_after": legacy, "c": c.flatten().tolist()}))
    """
)


def run_case(setting: str) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, setting],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fresh() -> dict:
    """The case of a process that set nothing."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has only the legacy TF32 flags")
    got = run_case("none")
    assert (got["before"], got["inside"], got["after"]) == ("none", "ieee", "none")
    return got


@pytest.mark.parametrize(
    ("setting", "before", "legacy_after"),
    [
        ("all_backends_tf32", "tf32", None),  # the legacy flag cannot be read in this process
        ("legacy_allow_tf32", "tf32", True),
        ("matmul_precision_high", "tf32", True),
    ],
)
def test_full_fp32_products_under_any_tf32_setting(
    setting: str, before: str, legacy_after: bool | None, fresh: dict
) -> None:
    """Inside the block the CUDA matmul precision is "ieee", after it the process's setting
    again (read through the API the process used), and the dequant backend's fp32 GEMM runs
    and gives the bits it gives in a process that set nothing."""
    got = run_case(setting)
    assert (got["before"], got["inside"], got["after"]) == (before, "ieee", before)
    assert got["legacy_after"] == legacy_after
    assert got["c"] == fresh["c"]  # the same fp32 products (the CPU has no TF32 anyway)
