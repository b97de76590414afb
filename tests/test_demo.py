"""The training demo (fp4gen demo) and the telemetry report (fp4gen report) end to end on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp4gen.cli import main
from fp4gen.demo import train
from fp4gen.demo.train import DemoConfig, plan_steps
from fp4gen.report import aggregate, fallback_summary

PNG = b"\x89PNG\r\n\x1a\n"


def test_demo_progress_summary_and_step_tagged_telemetry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--recipes", "bf16,mor_tensor", "--steps", "5", "--batch", "2"]
    argv += ["--eval-every", "2", "--device", "cpu", "--telemetry", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[mor_tensor] step     5/5" in out and "ETA" in out and "elapsed" in out
    assert "val - bf16" in out  # the summary table

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["size"] == "tiny"
    results = {r["recipe"]: r for r in summary["recipes"]}
    assert results["bf16"]["converted"] == 0 and results["mor_tensor"]["converted"] == 16
    assert all(r["steps"] == 5 and not r["stopped_early"] for r in results.values())

    records = json.loads((tmp_path / "telemetry.json").read_text())["records"]
    # steps 0, 2 and 4, each with the six operands of the 16 converted layers
    assert sorted({r["step"] for r in records}) == [0, 2, 4]
    assert len(records) == 3 * 16 * 6
    assert {r["recipe"] for r in records} == {"mor_tensor"}
    assert all(r["fallback"] in (0.0, 1.0) and r["units"] == 1 for r in records)

    assert main(["report", str(tmp_path / "telemetry.json"), "--by", "operand"]) == 0
    out = capsys.readouterr().out
    assert "kept in high precision" in out and "wgrad.activation" in out
    assert (tmp_path / "telemetry.png").read_bytes()[:8] == PNG
    assert (tmp_path / "telemetry_fallback.png").read_bytes()[:8] == PNG


def test_time_budget_fits_the_whole_run(monkeypatch: pytest.MonkeyPatch) -> None:
    cost = {"bf16": 0.01, "nvfp4_small": 0.5, "mor_tensor": 0.25}
    cals = {r: train.Calibration(c, 0.0, 0.0, 0.0, 5) for r, c in cost.items()}
    monkeypatch.setattr(train, "calibrate", lambda recipe, *a, **k: cals[recipe])
    lines: list[str] = []
    cfg = DemoConfig(recipes=tuple(cost), steps=1000, time_budget=100.0)
    steps, timing = plan_steps(cfg, b"", lines.append)
    # every recipe's steps together fit the budget left after calibration (here: all of it)
    assert steps == pytest.approx(100.0 * train.BUDGET_USE / sum(cost.values()), abs=1)
    assert timing == cals and f"{steps} steps per recipe" in lines[-1]
    # --steps stays the upper bound; no budget: no timing at all
    assert (
        plan_steps(DemoConfig(recipes=tuple(cost), steps=7, time_budget=100.0), b"", print)[0] == 7
    )
    assert plan_steps(DemoConfig(steps=9), b"", print) == (9, {})


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0", "--device", "cpu"]) == 1
    assert "--steps must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--time-budget", "-1", "--device", "cpu"]) == 1
    assert "--time-budget" in capsys.readouterr().err


def test_demo_help_lists_sizes_and_recipes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "medium  8 x 768" in out and "57M parameters: on an H100" in out
    assert "mor_subtensor_3way" in out and "nvfp4_small" in out and "--time-budget" in out


def _mor(recipe: str, layer: str, operand: str, step: int, units: int, kept: int) -> dict:
    hist = [0] * 41
    hist[3] = units
    return {
        "recipe": recipe,
        "layer": layer,
        "operand": operand,
        "step": step,
        "mor": "r",
        "threshold": 0.045,
        "units": units,
        "fallback": kept / units,
        "rel_error_hist": hist,
    }


def test_fallback_summary_weights_units_and_tracks_steps(tmp_path: Path) -> None:
    records = [
        _mor("a", "l0", "fprop.activation", 0, 4, 1),  # 1 of 4 units kept in BF16
        _mor("a", "l1", "fprop.activation", 0, 4, 3),
        _mor("a", "l0", "fprop.activation", 10, 8, 0),
        _mor("a", "l1", "fprop.activation", 10, 8, 2),
        _mor("a", "l0", "dgrad.gradient", 0, 2, 2),
        {"recipe": "b", "layer": "l0", "operand": "fprop.activation", "mean_rel_error": 0.3},
    ]
    (act, grad) = fallback_summary(records)
    assert (act.recipe, act.operand, act.records, act.units) == ("a", "fprop.activation", 4, 24)
    assert act.overall == pytest.approx(6 / 24)
    assert act.first == pytest.approx(4 / 8) and act.last == pytest.approx(2 / 16)
    assert act.worst_layer == "l1" and act.worst == pytest.approx(5 / 12)
    assert (grad.operand, grad.overall, grad.first, grad.last) == ("dgrad.gradient", 1.0, 1.0, 1.0)
    assert fallback_summary(records, "b") == []

    by_operand = aggregate(records, by="operand")
    assert by_operand.fallback[0] == pytest.approx(6 / 24)  # weighted by decision units
    assert by_operand.rows == [
        ("a", "all layers", "fprop.activation"),
        ("a", "all layers", "dgrad.gradient"),
        ("b", "all layers", "fprop.activation"),
    ]
    assert by_operand.counts[0][3] == 24 and by_operand.counts[2][40] == 1  # 30% -> 20%+ bin
    by_layer = aggregate(records)
    assert len(by_layer.rows) == 4

    path = tmp_path / "t.json"
    path.write_text(json.dumps(records))
    assert main(["report", str(path), "--json", "--out", str(tmp_path / "h.png")]) == 0
    assert (tmp_path / "h_fallback.png").read_bytes()[:8] == PNG


def test_runtime_notes_reach_the_demo_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import logging

    def fake_run(cfg: DemoConfig, log, files) -> list:
        logging.getLogger("fp4gen.runtime").info("quantize uses the reference: %s", "why")
        return []

    monkeypatch.setattr(train, "_run", fake_run)
    lines: list[str] = []
    assert train.run_demo(DemoConfig(out=tmp_path), lines.append) == []
    assert lines == ["note (fp4gen.runtime): quantize uses the reference: why"]
    assert not any(isinstance(h, train._LogLines) for h in logging.getLogger("fp4gen").handlers)


def _point(recipe: str, step: int, val: float | None) -> train.Point:
    return train.Point(recipe, step, 5.0, val, float(step))


def _result(recipe: str, steps: int, val: float, planned: int = 3) -> train.RecipeResult:
    return train.RecipeResult(recipe, 1000, 0, steps, planned, 1.0, 5.0, val, steps < planned)


def test_runs_of_unequal_length_are_compared_at_a_common_step() -> None:
    # bf16 stopped after 1 step, nvfp4_small after 3: their final losses are 2 steps apart
    points = [_point("bf16", 0, 5.50), _point("nvfp4_small", 0, 5.40)]
    points += [_point("nvfp4_small", 1, None), _point("nvfp4_small", 2, 4.85)]
    results = [_result("bf16", 1, 5.50), _result("nvfp4_small", 3, 4.85)]
    found = train.compare(points, "nvfp4_small", "bf16")
    assert found == train.Comparison("nvfp4_small", "bf16", 1, pytest.approx(-0.10), False)
    table, notes = train.summary_table(results, points)
    assert "-0.1000 @1" in table and "-0.6500" not in table  # not step 3 against step 1
    assert notes == [
        "nvfp4_small trained 3 steps and bf16 1: val - bf16 compares them after 1 step(s), the "
        "last both evaluated, not their final losses"
    ]
    # equal runs: the final losses, no note
    same = [_point("bf16", 0, 5.5), _point("bf16", 2, 5.0), *points[1:]]
    table, notes = train.summary_table([_result("bf16", 3, 5.0), results[1]], same)
    assert "-0.1500" in table and "@" not in table and notes == []
    # no step evaluated by both: said plainly, no number
    apart = [_point("bf16", 1, 5.0), _point("nvfp4_small", 2, 4.85)]
    assert train.compare(apart, "nvfp4_small", "bf16") is None
    table, notes = train.summary_table(results, apart)
    assert "none" in table.splitlines()[-1]
    assert notes == [
        "nvfp4_small and bf16 have no evaluated step in common: their held-out losses cannot "
        "be compared"
    ]
    assert train._comparisons_json(results, points) == [
        {
            "recipe": "nvfp4_small",
            "baseline": "bf16",
            "steps": 1,
            "val_gap": pytest.approx(-0.10),
            "at_final_steps": False,
        }
    ]


def _demo(out: Path) -> list[str]:
    return ["demo", "--recipes", "bf16", "--steps", "1", "--batch", "1", "--device", "cpu",
            "--out", str(out)]  # fmt: skip


def test_demo_writes_through_no_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / "users-file.json"
    victim.write_text("precious")
    for name in train.OUTPUT_FILES:
        out = tmp_path / f"out-{name}"
        out.mkdir()
        (out / name).symlink_to(victim)
        assert main(_demo(out)) == 1
        captured = capsys.readouterr()
        assert captured.out == ""  # refused before anything trained
        assert captured.err == (
            f"fp4gen demo: {out / name} is a symbolic link (to {victim}): fp4gen writes no file "
            "through a link; remove the link or choose another --out\n"
        )
    assert victim.read_text() == "precious"


def test_demo_on_a_full_disk_keeps_the_old_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    from fp4gen import outputs

    out = tmp_path / "out"
    out.mkdir()
    (out / "losses.csv").write_text("old\n")

    def full_disk(file, data: bytes) -> None:
        file.write(data[:5])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs, "_write_data", full_disk)
    assert main(_demo(out)) == 1
    err = capsys.readouterr().err
    assert err == (
        f"fp4gen demo: cannot write {out / 'losses.csv'}: No space left on device (the previous "
        "file is unchanged)\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["losses.csv"]
    assert (out / "losses.csv").read_text() == "old\n"
    monkeypatch.undo()
    assert main(_demo(out)) == 0
    stdout = capsys.readouterr().out
    assert f"replaced 1 existing file(s) in {out}: losses.csv" in stdout
    assert (out / "losses.csv").read_text().startswith("recipe,step,train_loss")


def test_report_writes_through_no_link_and_whole_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    from fp4gen import outputs

    records = [_mor("a", "l0", "fprop.activation", s, 4, 1) for s in (0, 10)]
    telemetry = tmp_path / "t.json"
    telemetry.write_text(json.dumps(records))
    victim = tmp_path / "users-picture.png"
    victim.write_bytes(b"precious")
    for name in ("h.png", "h_fallback.png"):
        out = tmp_path / f"out-{name}"
        out.mkdir()
        (out / name).symlink_to(victim)
        assert main(["report", str(telemetry), "--out", str(out / "h.png")]) == 1
        err = capsys.readouterr().err
        assert err == (
            f"fp4gen report: {out / name} is a symbolic link (to {victim}): fp4gen writes no "
            "file through a link; remove the link or choose another --out\n"
        )
        assert [p.name for p in out.iterdir()] == [name]
    assert victim.read_bytes() == b"precious"

    out = tmp_path / "h.png"
    out.write_bytes(b"old picture")

    def full_disk(file, data: bytes) -> None:
        file.write(data[:4])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def savefig_full_disk(self, fname, **kwargs) -> None:  # matplotlib writes by name
        with open(fname, "wb") as f:
            outputs._write_data(f, PNG * 100)

    import matplotlib.figure

    monkeypatch.setattr(outputs, "_write_data", full_disk)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig_full_disk)
    assert main(["report", str(telemetry), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.endswith(
        f"cannot write {out}: No space left on device (the previous file is unchanged)\n"
    )
    assert "Traceback" not in err and err.count("\n") == 1
    assert out.read_bytes() == b"old picture"
    assert sorted(p.name for p in tmp_path.glob("h*")) == ["h.png"]  # no partial, no temp
    monkeypatch.undo()
    assert main(["report", str(telemetry), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert f"replaced 1 existing file(s) in {tmp_path}: h.png" in stdout
    assert out.read_bytes()[:8] == PNG and (tmp_path / "h_fallback.png").read_bytes()[:8] == PNG
