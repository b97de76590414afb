"""Non-finite inputs on the quantize paths (``fp4gen.runtime.finite``): raised at once, read back
at the end of a block, or propagated into the global scale; run on CPU tensors (the reductions
are the same torch ops)."""

from __future__ import annotations

import pytest
import torch

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.runtime import finite


def test_check_raises_at_once_outside_a_block() -> None:
    finite.check(torch.ones(4, 4), "x")
    bad = torch.ones(4, 4)
    bad[2, 3] = float("inf")
    with pytest.raises(TensorError, match=r"x has 1 non-finite value.*index \(2, 3\)"):
        finite.check(bad, "x")


def test_deferred_checks_raise_when_the_block_ends() -> None:
    bad = torch.zeros(3, 5)
    bad[1, 4] = float("nan")
    reached = []
    second = r"second has 1 non-finite value.*index \(1, 4\)"
    with pytest.raises(TensorError, match=second), finite.deferred():
        finite.check(torch.ones(2, 2), "first")
        finite.check(bad, "second")
        reached.append(True)  # no read-back yet: the block runs to its end
    assert reached == [True]
    with finite.deferred():  # all finite: nothing raised, and the state is reset
        finite.check(torch.ones(2, 2), "first")
    with pytest.raises(TensorError):
        finite.check(bad, "outside")


def test_nested_blocks_share_the_outer_read_and_errors_pass_through() -> None:
    bad = torch.full((2,), float("-inf"))
    reached = []
    with pytest.raises(TensorError, match="inner"), finite.deferred():
        with finite.deferred():
            finite.check(bad, "inner")
        reached.append(True)  # the inner block ended without reading back
    assert reached == [True]
    with pytest.raises(ValueError, match="unrelated"), finite.deferred():
        finite.check(bad, "skipped")
        raise ValueError("unrelated")  # the block's own error wins; no check runs
    finite.check(torch.ones(1), "after")  # not deferred any more


def test_propagating_scope_returns_the_flag_and_poisons_the_global_scale() -> None:
    bad = torch.ones(4, 4)
    bad[0, 0] = float("nan")
    scale = torch.tensor(0.5)
    with finite.propagating():
        good_flag = finite.check(torch.ones(4, 4), "good")
        bad_flag = finite.check(bad, "bad")  # no error: the flag carries it
    assert bool(good_flag) and not bool(bad_flag)
    assert finite.poison(scale, good_flag).item() == 0.5
    assert torch.isnan(finite.poison(scale, bad_flag))
    assert finite.poison(scale, None) is scale
    assert finite.check(torch.ones(2), "outside") is None  # the scope has ended


def test_layer_mode_picks_the_scope(monkeypatch) -> None:
    bad = torch.full((3,), float("inf"))
    assert finite.layer_mode() == "propagate"  # the default
    with finite.layer_scope():
        assert finite.check(bad, "x") is not None
    monkeypatch.setattr(finite, "_layer_mode", ["propagate"])
    finite.set_layer_mode("raise")
    with pytest.raises(TensorError, match="x has 3 non-finite"), finite.layer_scope():
        assert finite.check(bad, "x") is None
    with pytest.raises(FP4GenError, match="expected one of propagate, raise"):
        finite.set_layer_mode("ignore")
    monkeypatch.setenv("FP4GEN_CHECK_FINITE", "sometimes")
    with pytest.raises(FP4GenError, match="FP4GEN_CHECK_FINITE='sometimes'"):
        finite.mode_from_env()
    monkeypatch.setattr(finite, "_layer_mode", [None])  # read on first use, not at import
    with pytest.raises(FP4GenError, match="FP4GEN_CHECK_FINITE='sometimes'"):
        finite.layer_mode()


def test_cli_reports_a_bad_setting_before_any_command(monkeypatch, capsys) -> None:
    from fp4gen.cli import main

    monkeypatch.setenv("FP4GEN_CHECK_FINITE", "bogus")
    assert main(["formats"]) == 1
    err = capsys.readouterr().err
    assert err == "fp4gen formats: FP4GEN_CHECK_FINITE='bogus': expected one of propagate, raise\n"
