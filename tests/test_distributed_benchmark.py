"""benchmarks/distributed.py runs end to end on the CPU (gloo, 1 and 2 ranks, tiny Llama) and
reports the all-gather bytes that the parameter sizes give."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, LAYERS, VOCAB, FFN = 64, 2, 256, 256  # FFN: 256 * round(8 * 64 / 3 / 256)

pytest.importorskip("transformers")


def expected_gather_mb(quantized_blocks: int) -> tuple[str, str]:
    """(bf16, quantized-projection) MB one of 2 ranks receives per step, counted by hand: each
    block gathered twice (forward, backward), the root (embedding, final norm, head) once; a
    rank receives half. nvfp4_small keeps the last block and the head in BF16; its weights are
    NVFP4 in 16x16 tiles: 4-bit codes and one E4M3 scale per 256 elements."""
    linears = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN  # q, k, v, o; gate, up, down
    block = linears + 2 * HIDDEN  # two RMSNorm weights
    root = 2 * VOCAB * HIDDEN + HIDDEN
    bf16 = (2 * LAYERS * block + root) * 2
    quantized = bf16 - 2 * quantized_blocks * linears * (2 - (0.5 + 1 / 256))
    return f"{bf16 / 2 / 1e6:.3f}", f"{quantized / 2 / 1e6:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-gather", "quantized-gather"])
def test_benchmark_smoke_on_cpu(quantized: bool) -> None:
    """The table at 1 and 2 gloo ranks; with the quantized all-gather too (at one rank FSDP2
    gathers nothing and the option steps aside: docs/distributed.md)."""
    cmd = [
        sys.executable,
        "benchmarks/distributed.py",
        "--device", "cpu", "--world", "2", "--model", "llama",
        "--hidden", str(HIDDEN), "--layers", str(LAYERS), "--seq", "16", "--tokens", "32",
        "--steps", "2", "--recipes", "bf16,recipes/nvfp4_small.fp4r",
    ]  # fmt: skip
    cmd += ["--quantized-all-gather"] if quantized else []
    # its own session, so that a timeout ends the ranks it spawned too, not only the launcher
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("benchmarks/distributed.py ran past 240 s")
    assert proc.returncode == 0, stdout + stderr
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"\s+(\d+) (\S+)\s+(\d+)\s+([\d.]+)x\s+(\d+)%\s+([\d.]+)\s+([\d.]+)$", line)
        if m:
            rows[(int(m[1]), m[2])] = m.groups()[2:]
    assert set(rows) == {(w, r) for w in (1, 2) for r in ("bf16", "nvfp4_small")}, stdout
    for (world, recipe), (tokens_s, ratio, scaling, gather, gather_quantized) in rows.items():
        assert int(tokens_s) > 0
        if recipe == "bf16":
            assert ratio == "1.00"
        if world == 1:
            assert scaling == "100" and gather == gather_quantized == "0.000"
    assert rows[(2, "bf16")][3:] == expected_gather_mb(quantized_blocks=0)
    assert rows[(2, "bf16")][3] == rows[(2, "nvfp4_small")][3]  # bf16 gathers either way
    assert rows[(2, "nvfp4_small")][4] == expected_gather_mb(quantized_blocks=1)[1]
