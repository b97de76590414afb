"""The fp4gen command line, run in-process through ``fp4gen.cli.main``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4gen.cli import CLOSED_PIPE_STATUS, main

RECIPES = Path(__file__).resolve().parent.parent / "fp4gen" / "recipes"
SHIPPED = sorted(RECIPES.glob("*.fp4r"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_shipped_recipes_exist() -> None:
    names = {p.stem for p in SHIPPED}
    assert {"nvfp4", "mxfp4", "mxfp8", "fp8_blockwise", "mor_tensor"} <= names


def test_check_all_shipped(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check", *map(str, SHIPPED))
    assert code == 0, err
    assert out.count("ok ") == len(SHIPPED)


def test_check_reports_error_with_location(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.fp4r"
    bad.write_text("operands {\n    * : nvfp5\n}\n")
    good = RECIPES / "nvfp4.fp4r"
    code, out, err = run(capsys, "check", str(good), str(bad))
    assert code == 1
    assert "ok  " in out
    assert f"{bad}:2:9" in err
    assert "nvfp5" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_show_every_shipped(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", str(path))
    assert code == 0
    assert "GEMM operands" in out
    for gemm in ("fprop", "dgrad", "wgrad"):
        assert gemm in out


def test_show_nvfp4_table_values(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", str(RECIPES / "nvfp4.fp4r"))
    assert code == 0
    lines = {tuple(line.split()[:3]): line for line in out.splitlines() if line.strip()}
    wgrad_grad = lines[("wgrad", "gradient", "columnwise")]
    assert "stochastic" in wgrad_grad and "16 (signs te)" in wgrad_grad
    fprop_weight = lines[("fprop", "weight", "rowwise")]
    assert "16x16" in fprop_weight and "2d" in fprop_weight and "e4m3 (nearest)" in fprop_weight
    assert "bf16" in out  # layer rules keep first/last blocks in bf16


def test_show_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", str(RECIPES / "nvfp4.fp4r"), "--json")
    assert code == 0
    data = json.loads(out)
    op = data["operands"]["wgrad.gradient"]
    assert op["use"] == "columnwise"
    assert op["rounding"] == "stochastic8"
    assert op["rht"]["size"] == 16
    assert op["format"]["element"]["name"] == "e2m1"
    assert op["format"]["scale"]["format"] == "e4m3"
    assert data["operands"]["fprop.weight"]["format"]["block"] == [16, 16]
    assert data["gemm_paths"]["wgrad"]["path"].startswith("dequantize to bf16")
    assert len(data["kernel_plan"]["kernels"]) == 3


def test_show_gemm_paths_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", str(RECIPES / "fp8_blockwise.fp4r"))
    assert code == 0
    # fp32 block scales: e4m3 x fp32 needs 28 significant bits, so no exact bf16 path
    assert "dequantize to fp32 + fp32 GEMM (no TF32)" in out
    assert "28 significant bits" in out
    assert "kernel plan for recipe fp8_blockwise: 2 quantize kernel(s)" in out


def test_show_canonical_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    from fp4gen.dsl import load_recipe, parse_recipe

    path = RECIPES / "nvfp4_no_sr.fp4r"  # uses extends: the canonical text inlines it
    code, out, _ = run(capsys, "show", str(path), "--canonical")
    assert code == 0
    assert "extends" not in out
    assert parse_recipe(out, base_dir=RECIPES) == load_recipe(path)


def test_error_on_format(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "error", "nvfp4", "--shape", "64x64", "--json")
    assert code == 0
    data = json.loads(out)
    (res,) = data["results"]
    # NVFP4 RNE on Gaussian data: relative error is about 10%; SNR about 20 dB.
    assert 0.05 < res["relative_error"] < 0.2
    assert 15 < res["snr_db"] < 25
    # The e4m3 block scale rounds to nearest, so about half the blocks get a scale just below
    # amax/6 and their largest element clips slightly: ~1/32 of the elements.
    assert 0.01 < res["saturated"] < 0.06


def test_error_round_up_scales_never_saturate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "error", "mxfp4", "--shape", "64x64", "--dist", "laplace", "--json")
    assert code == 0
    (res,) = json.loads(out)["results"]
    assert res["saturated"] == 0.0


def test_error_on_recipe_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "error", str(RECIPES / "nvfp4.fp4r"), "--shape", "64x64")
    assert code == 0
    assert "SNR dB" in out
    assert "wgrad.gradient" in out


def test_error_on_saved_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.pt"
    torch.save(torch.ones(32, 32), path)
    code, out, _ = run(capsys, "error", "mxfp8_e4m3", "--tensor", str(path), "--json")
    assert code == 0
    (res,) = json.loads(out)["results"]
    assert res["relative_error"] == 0.0  # 1.0 is exact in every format


def test_error_bad_target(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "error", "bf16")
    assert code == 1
    assert "high-precision" in err


def test_bad_shape_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["error", "nvfp4", "--shape", "12"])
    assert exc.value.code == 2
    assert "4096x4096" in capsys.readouterr().err


def test_formats_lists_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "formats")
    assert code == 0
    for name in ("nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"):
        assert name in out


@pytest.mark.parametrize("command", ["check", "show", "error", "formats"])
def test_help_everywhere(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: fp4gen" in capsys.readouterr().out


def test_console_entry_point_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fp4gen", "show", str(RECIPES / "mxfp4.fp4r")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "mxfp4" in proc.stdout


def _closed_pipe_run(*argv: str) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m fp4gen ARGV`` with its stdout a pipe whose reader is already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "fp4gen", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            check=False,
            timeout=120,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "argv",
    [("show", "nvfp4"), ("show", "nvfp4", "--json"), ("formats",), ("check", "nvfp4", "mxfp4")],
    ids=lambda argv: " ".join(argv),
)
def test_a_closed_pipe_ends_the_command_quietly(argv: tuple[str, ...]) -> None:
    proc = _closed_pipe_run(*argv)
    assert (proc.returncode, proc.stderr.decode()) == (CLOSED_PIPE_STATUS, "")


def test_a_reader_that_stops_early_ends_the_command_quietly() -> None:
    # `fp4gen check nvfp4 ... | head -1`: more output than a pipe holds, read one line, close
    names = ["nvfp4"] * 6000  # 20 bytes a line: about 120 KB
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp4gen", "check", *names],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == CLOSED_PIPE_STATUS
    assert (first, err) == (b"ok  nvfp4  (nvfp4)\n", b"")


def test_a_broken_pipe_that_is_not_stdout_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a pipe to a child process that died is a failure to report, not a reader that left
    def broken(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("fp4gen.cli.cmd_formats", broken)  # read when the parser is built
    assert run(capsys, "formats") == (1, "", "fp4gen formats: Broken pipe\n")


def test_demo_writes_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "demo",
        "--recipes",
        "bf16,nvfp4_small",
        "--steps",
        "3",
        "--eval-every",
        "2",
        "--batch",
        "4",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
    )
    assert code == 0
    rows = (tmp_path / "losses.csv").read_text().splitlines()
    assert rows[0] == "recipe,step,train_loss,val_loss,seconds"
    assert len(rows) == 1 + 2 * 3
    assert "[nvfp4_small]" in out and "linear layers converted" in out
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
