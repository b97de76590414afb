"""fp4gen's settings read from the environment, checked where they are read (no torch import, so
the command line can check them before any command runs)."""

from __future__ import annotations

import os

from fp4gen.errors import FP4GenError

CHECK_FINITE_VAR = "FP4GEN_CHECK_FINITE"
# how fp4gen.nn.Linear treats a NaN or Inf input on CUDA (fp4gen.runtime.finite)
LAYER_MODES = ("propagate", "raise")


def check_finite_mode() -> str:
    """The mode ``FP4GEN_CHECK_FINITE`` names ("propagate" when unset); FP4GenError for any
    other value, so a misspelt setting is never ignored."""
    mode = os.environ.get(CHECK_FINITE_VAR, "propagate")
    if mode not in LAYER_MODES:
        raise FP4GenError(f"{CHECK_FINITE_VAR}={mode!r}: expected one of {', '.join(LAYER_MODES)}")
    return mode


def check_environment() -> None:
    """FP4GenError for any fp4gen setting in the environment that names no valid value."""
    check_finite_mode()
