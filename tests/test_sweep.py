"""fp4gen sweep on the CPU: the files of a tiny sweep, resuming, the shared data order, the
Student-t interval and one-line errors for bad input (all checked before anything trains)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from fp4gen.cli import main
from fp4gen.experiments import sweep
from fp4gen.experiments.data import load_data
from fp4gen.experiments.models import MODELS, build_model
from fp4gen.experiments.progress import Progress
from fp4gen.experiments.stats import t_cdf, t_interval, t_quantile

PNG = b"\x89PNG\r\n\x1a\n"
# 3 steps of 2 x 64 tokens, evaluated after steps 2 and 3 on one held-out batch: seconds
TINY = ["--tokens", "384", "--batch", "2", "--eval-every", "2", "--eval-batches", "1"]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: these models are too small to gain from a second, and on a CI machine
    that other jobs share, threads waiting for each other at every op make the sweep up to 10x
    slower (docs/experiments.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sweep(tmp_path: Path) -> list[str]:
    return ["sweep", "nvfp4_small", "--seeds", "2", "--device", "cpu", "--out", str(tmp_path)]


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Counts the trainings and records a digest of every training batch per (recipe, seed)."""
    seen: dict[str, list] = {"runs": [], "batches": []}
    real_train, real_loss = sweep.train_run, sweep.model_loss

    def train_run(plan, entry, seed, held_out, progress):
        seen["runs"].append((entry.label, seed))
        return real_train(plan, entry, seed, held_out, progress)

    def model_loss(model, spec, x, y):
        if torch.is_grad_enabled():  # a training step, not a held-out evaluation
            digest = hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest()
            seen["batches"].append((seen["runs"][-1], digest))
        return real_loss(model, spec, x, y)

    monkeypatch.setattr(sweep, "train_run", train_run)
    monkeypatch.setattr(sweep, "model_loss", model_loss)
    return seen


def test_tiny_sweep_files_resume_and_shared_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], watched: dict[str, list]
) -> None:
    argv = [*_sweep(tmp_path), *TINY]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert watched["runs"] == [("bf16", 0), ("nvfp4_small", 0), ("bf16", 1), ("nvfp4_small", 1)]
    assert "gap to bf16 (95% CI)" in out and "distinguishable at 95%" in out
    assert "done: held-out loss" in out and "ETA" in out  # plain progress lines (not a TTY)

    # the same seed: the same batches for both recipes; another seed: other batches
    batches: dict[tuple[str, int], list[str]] = {}
    for run, digest in watched["batches"]:
        batches.setdefault(run, []).append(digest)
    assert all(len(b) == 3 for b in batches.values())
    assert batches[("bf16", 0)] == batches[("nvfp4_small", 0)]
    assert batches[("bf16", 1)] == batches[("nvfp4_small", 1)]
    assert batches[("bf16", 0)] != batches[("bf16", 1)]

    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == [f"{r}__seed{s}.json" for r in ("bf16", "nvfp4_small") for s in (0, 1)]
    run = json.loads((tmp_path / "runs" / "nvfp4_small__seed1.json").read_text())
    assert run["seed"] == 1 and run["converted_layers"] == 12 and len(run["train_loss"]) == 3
    assert [s for s, _ in run["eval"]] == [1, 2]

    with (tmp_path / "losses.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["recipe", "seed", "step", "tokens", "train_loss", "eval_loss"]
    assert len(rows) == 4 * 3
    assert [r["tokens"] for r in rows[:3]] == ["128", "256", "384"]
    assert [bool(r["eval_loss"]) for r in rows[:3]] == [False, True, True]

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["complete"] and summary["runs_finished"] == summary["runs_planned"] == 4
    assert summary["steps"] == 3 and summary["tokens_per_run"] == 384
    assert summary["confidence"] == 0.95 and summary["baseline"] == "bf16"
    rows_by_recipe = {r["recipe"]: r for r in summary["recipes"]}
    assert list(rows_by_recipe) == ["bf16", "nvfp4_small"]
    assert rows_by_recipe["bf16"]["gap_to_bf16_percent"] is None
    gap = rows_by_recipe["nvfp4_small"]["gap_to_bf16_percent"]
    assert set(gap) >= {"values", "mean", "std", "ci_low", "ci_high", "distinguishable"}
    assert gap["paired_seeds"] == [0, 1] and gap["distinguishable"] in ("yes", "no")
    assert gap["ci_low"] <= gap["mean"] <= gap["ci_high"]
    final = rows_by_recipe["nvfp4_small"]["final_eval_loss"]
    base = rows_by_recipe["bf16"]["final_eval_loss"]["values"]
    expected = [100 * (x - b) / b for x, b in zip(final["values"], base, strict=True)]
    assert gap["values"] == pytest.approx(expected)
    for png in ("loss_vs_tokens.png", "gap_to_bf16.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG

    # resume: a lost run trains again, the finished ones are skipped and said to be
    (tmp_path / "runs" / "nvfp4_small__seed1.json").unlink()
    watched["runs"].clear()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert watched["runs"] == [("nvfp4_small", 1)]
    assert "resuming: 3 of 4 runs already finished" in out and "skipped" in out
    assert json.loads((tmp_path / "summary.json").read_text())["complete"]

    # everything finished: nothing trains; other settings in the same folder: refused
    watched["runs"].clear()
    assert main(argv) == 0
    assert watched["runs"] == [] and "nothing to train" in capsys.readouterr().out
    assert main([*argv, "--lr", "0.001"]) == 1
    err = capsys.readouterr().err
    assert "trained with other settings" in err and "lr" in err and watched["runs"] == []


def test_one_seed_llama_and_token_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    tokens = np.random.default_rng(0).integers(0, 300, size=4000).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    argv = ["sweep", "nvfp4_small", "--model", "llama-tiny", "--seeds", "1", "--device", "cpu"]
    argv += ["--data", str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "out")]
    argv += ["--tokens", "256", "--batch", "2", "--eval-batches", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "interval undefined: 1 seed" in out and "undefined" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["data"]["vocab"] == int(tokens.max()) + 1
    gap = summary["recipes"][1]["gap_to_bf16_percent"]
    assert gap["ci_low"] is None and gap["distinguishable"] is None and "undefined" in gap["note"]


def test_same_seed_same_initial_weights_across_recipes(tmp_path: Path) -> None:
    plan = sweep.prepare(
        sweep.SweepConfig(recipes=("nvfp4_small",), device="cpu", out=tmp_path), log=print
    )
    bf16, nvfp4 = plan.recipes
    a = sweep.build_run_model(plan, bf16, 0).state_dict()
    b = sweep.build_run_model(plan, nvfp4, 0).state_dict()
    c = sweep.build_run_model(plan, bf16, 1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [
        # printed Student-t tables (two-sided 95%, 90%, 99%)
        (0.975, 1, 12.706204736),
        (0.975, 2, 4.302652730),
        (0.975, 4, 2.776445105),
        (0.975, 9, 2.262157163),
        (0.975, 29, 2.045229642),
        (0.95, 10, 1.812461123),
        (0.995, 5, 4.032142984),
        (0.975, 1000, 1.962339081),
    ],
)
def test_t_quantile_known_values(p: float, df: float, expected: float) -> None:
    assert t_quantile(p, df) == pytest.approx(expected, rel=1e-8)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, rel=1e-8)
    assert t_cdf(expected, df) == pytest.approx(p, abs=1e-9)
    # many degrees of freedom: the normal quantile, plus its first correction (z^3 + z) / 4df
    z = 1.959963985
    assert t_quantile(0.975, 1e6) == pytest.approx(z + (z**3 + z) / 4e6, rel=1e-9)


def test_t_quantile_closed_forms_and_scipy() -> None:
    for p in (0.6, 0.9, 0.975, 0.999):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
        two = (2 * p - 1) / math.sqrt(2 * p * (1 - p))
        assert t_quantile(p, 2) == pytest.approx(two, rel=1e-9)
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 3, 7, 30, 31, 200):
        for p in (0.55, 0.95, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-8)


def test_t_interval() -> None:
    ci = t_interval([1.0, 2.0, 3.0, 4.0, 5.0], 0.95)
    half = 2.776445105 * math.sqrt(2.5) / math.sqrt(5)
    assert ci.mean == 3.0 and ci.std == pytest.approx(math.sqrt(2.5))
    assert (ci.low, ci.high) == (pytest.approx(3 - half), pytest.approx(3 + half))
    assert ci.distinguishable is True
    assert t_interval([-1.0, 1.0, 0.5], 0.95).distinguishable is False
    one = t_interval([0.3])
    assert one.low is None and one.high is None and one.distinguishable is None


def test_progress_eta_weighs_each_recipe_by_its_pace() -> None:
    runs = [("bf16", 0), ("slow", 0), ("bf16", 1), ("slow", 1)]
    progress = Progress(runs, steps=10, stream=io.StringIO(), bar=False)
    progress.timed = {"bf16": (1.0, 10), "slow": (10.0, 10)}
    progress.run_index, progress.run_step = 2, 0  # about to start bf16 seed 1
    progress.run_recipe, progress.run_seed = "bf16", 1
    assert progress.eta() == (pytest.approx(10 * 0.1 + 10 * 1.0), True)
    progress.timed = {"bf16": (1.0, 10)}  # "slow" untimed: guessed, and flagged
    assert progress.eta()[1] is False


def test_load_data_kinds(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello sweep " * 200)
    assert load_data(str(text), 64).vocab == 256
    torch.save(torch.arange(3000) % 500, tmp_path / "tokens.pt")
    data = load_data(str(tmp_path / "tokens.pt"), 64)
    assert data.vocab == 500 and data.tokens.dtype == torch.int64
    assert load_data(None, 64).fingerprint == load_data(None, 64).fingerprint


def test_model_table_counts_are_exact() -> None:
    for name in ("gpt-tiny", "llama-tiny"):
        if name.startswith("llama"):
            pytest.importorskip("transformers")
        spec = MODELS[name]
        with torch.device("meta"):
            model = build_model(spec, 300)
        assert spec.parameters(300) == sum(p.numel() for p in model.parameters())
    from fp4gen.demo.train import SIZES

    for size, cfg in SIZES.items():  # the GPT sizes are the demo's
        spec = MODELS[f"gpt-{size}"]
        assert (spec.layers, spec.width, spec.heads, spec.context) == (
            cfg.layers,
            cfg.width,
            cfg.heads,
            cfg.context,
        )


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    floats = tmp_path / "floats.npy"
    np.save(floats, np.zeros(5000, dtype=np.float32))
    negative = tmp_path / "negative.npy"
    np.save(negative, -np.ones(5000, dtype=np.int64))
    torch.save({"tokens": torch.arange(10)}, tmp_path / "dict.pt")
    (tmp_path / "short.txt").write_text("too short")
    (tmp_path / "broken.npy").write_bytes(b"not numpy")
    (tmp_path / "a_file").write_text("")
    return [
        (["no_such_recipe"], "no_such_recipe"),
        (["nvfp4_small", "no_such_recipe"], "no_such_recipe"),  # checked before any trains
        (["nvfp4_small", "--seeds", "0"], "--seeds must be at least 1"),
        (["nvfp4_small", "--tokens", "0"], "--tokens"),
        (["nvfp4_small", "--tokens", "lots"], "--tokens 'lots'"),
        (["nvfp4_small", "--tokens", "nan"], "--tokens"),
        (["nvfp4_small", "--confidence", "1.5"], "--confidence"),
        (["nvfp4_small", "--confidence", "nan"], "--confidence"),
        (["nvfp4_small", "--lr", "-1"], "--lr"),
        (["nvfp4_small", "--batch", "0"], "--batch"),
        (["nvfp4_small", "--model", "gpt-huge"], "unknown model"),
        (["nvfp4_small", "--data", str(tmp_path / "missing.txt")], "no such file"),
        (["nvfp4_small", "--data", str(tmp_path)], "not a regular file"),
        (["nvfp4_small", "--data", str(floats)], "holds integers"),
        (["nvfp4_small", "--data", str(negative)], "non-negative"),
        (["nvfp4_small", "--data", str(tmp_path / "dict.pt")], "holds one tensor"),
        (["nvfp4_small", "--data", str(tmp_path / "short.txt")], "too short"),
        (["nvfp4_small", "--data", str(tmp_path / "broken.npy")], "not a readable .npy"),
        (["nvfp4_small", "--out", str(tmp_path / "a_file")], "not a folder"),
    ]


def test_gpu_models_widths_fit_every_shipped_block_size() -> None:
    """The GPU models' GEMM widths are multiples of 128 (FP8's 1x128 blocks, 128x128 weight
    tiles): a width that is not leaves the fused kernels for the reference quantize and the
    exact fp32 GEMM, 3x slower on llama-wide's down projection (docs/experiments.md)."""
    wide = MODELS["llama-wide"]
    assert wide.intermediate == 11008  # Llama 2 7B's: 8/3 x 4096 rounded up to 256
    for spec in MODELS.values():
        if spec.width >= 384:
            assert spec.width % 128 == 0 and spec.intermediate % 128 == 0, spec.name
    assert MODELS["llama-medium"].intermediate == 2048  # the ablation runs' model, unchanged


def test_bad_inputs_are_one_line_errors_before_any_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("a run started before the input was checked")

    monkeypatch.setattr(sweep, "train_run", no_training)
    for args, message in _bad_inputs(tmp_path):
        # the case's own --out comes last, and wins
        code = main(["sweep", "--out", str(tmp_path / "out"), "--device", "cpu", *args])
        err = capsys.readouterr().err
        assert code == 1, args
        assert message in err and "Traceback" not in err, (args, err)
        assert err.startswith("fp4gen sweep: ") and err.count("\n") == 1, (args, err)


def test_missing_transformers_and_cuda_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fp4gen.experiments import models

    def no_transformers(name: str) -> object:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(models.importlib, "import_module", no_transformers)
    assert main(["sweep", "nvfp4_small", "--model", "llama-small", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "needs transformers" in err and "fp4gen[hf]" in err and err.count("\n") == 1
    if not torch.cuda.is_available():
        assert main(["sweep", "nvfp4_small", "--device", "cuda", "--out", str(tmp_path)]) == 1
        assert "no CUDA device" in capsys.readouterr().err


def test_sweep_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sweep", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: fp4gen sweep" in out
    assert all(name in out for name in MODELS)


def test_interrupt_says_how_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "train_run", interrupted)
    assert main([*_sweep(tmp_path), *TINY]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "run the same command again to resume" in err
    assert "Traceback" not in err


def test_the_ablation_recipes_quantize_the_papers_blocks_of_llama_medium() -> None:
    """On llama-medium (16 blocks of 7 linear layers, and the head) the paper's layer rules
    leave 6 blocks in NVFP4 for the full method and its ablations, 8 for MXFP4 (last 8 blocks
    kept), 12 for the fewer-BF16-blocks ablation (last 4 kept) and all 16 for the no-BF16
    ablation (only the head kept): the counts the sweep prints and docs/experiments.md reports."""
    pytest.importorskip("transformers")
    names = ("nvfp4", "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights", "mxfp4")
    names += ("nvfp4_bf16_switch", "nvfp4_fewer_bf16", "nvfp4_no_bf16")
    entries = sweep._load_recipes(names, MODELS["llama-medium"], 256)
    counts = {e.label: (e.quantized, e.linears) for e in entries}
    assert counts == {
        "bf16": (0, 113),
        **{name: (6 * 7, 113) for name in names},
        "mxfp4": (8 * 7, 113),
        "nvfp4_fewer_bf16": (12 * 7, 113),
        "nvfp4_no_bf16": (16 * 7, 113),
    }


def test_sweep_writes_through_no_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("a run started before the output files were checked")

    monkeypatch.setattr(sweep, "train_run", no_training)
    victim = tmp_path / "users-file.json"
    victim.write_text("precious")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for i, name in enumerate(("summary.json", "loss_vs_tokens.png", "runs/bf16__seed1.json")):
        out = tmp_path / f"out{i}"
        (out / "runs").mkdir(parents=True)
        (out / name).symlink_to(victim)
        assert main([*_sweep(out), *TINY]) == 1
        err = capsys.readouterr().err
        assert err == (
            f"fp4gen sweep: {out / name} is a symbolic link (to {victim}): fp4gen writes no "
            "file through a link; remove the link or choose another --out\n"
        )
    out = tmp_path / "out-runs"
    out.mkdir()
    (out / "runs").symlink_to(elsewhere)  # runs/ itself leads out of --out
    assert main([*_sweep(out), *TINY]) == 1
    err = capsys.readouterr().err
    assert "leads out of" in err and "through a symbolic link" in err and err.count("\n") == 1
    assert victim.read_text() == "precious" and list(elsewhere.iterdir()) == []


def test_sweep_on_a_full_disk_leaves_no_partial_run_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    from fp4gen import outputs

    def fake_run(plan, entry, seed, held_out, progress) -> dict:
        return {"format": sweep.RUN_FORMAT, "label": entry.label, "seed": seed, "pad": "x" * 99}

    def full_disk(file, data: bytes) -> None:  # 20 bytes fit (the empty probe file does)
        file.write(data[:20])
        if len(data) > 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sweep, "train_run", fake_run)
    monkeypatch.setattr(outputs, "_write_data", full_disk)
    assert main([*_sweep(tmp_path), *TINY]) == 1
    err = capsys.readouterr().err
    run_file = tmp_path / "runs" / "bf16__seed0.json"
    assert err.splitlines()[-1] == (
        f"fp4gen sweep: cannot write {run_file}: No space left on device (nothing was written)"
    )
    assert "Traceback" not in err
    assert list(tmp_path.rglob("*")) == [tmp_path / "runs"]  # no partial file, no temporary


def test_a_runtime_note_is_written_once_per_sweep() -> None:
    """Every run converts a fresh model, and convert lists the parameters it keeps in high
    precision each time: the sweep's log shows each note's text once, a new text when it
    comes."""
    from fp4gen.experiments.sweep import _runtime_notes

    class Lines:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def write(self, line: str) -> None:
            self.lines.append(line)

    progress = Lines()
    runtime = logging.getLogger("fp4gen.runtime")
    with _runtime_notes(progress):  # type: ignore[arg-type]
        for _ in range(3):  # three runs of one recipe
            runtime.info("fp4gen.convert left 2 parameters in high precision")
        runtime.info("quantize uses the reference: why")
        runtime.info("fp4gen.convert left 2 parameters in high precision")
    assert progress.lines == [
        "note (fp4gen.runtime): fp4gen.convert left 2 parameters in high precision",
        "note (fp4gen.runtime): quantize uses the reference: why",
    ]
