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


LAYER_GRAPHS_VAR = "FP4GEN_LAYER_GRAPHS"
_SWITCH = {"1": True, "on": True, "0": False, "off": False}


def layer_graphs_enabled() -> bool:
    """Whether fp4gen.nn.Linear replays its CUDA work from per-layer CUDA graphs
    (``FP4GEN_LAYER_GRAPHS``: 1/on, the default, or 0/off; fp4gen.runtime.layer_graphs).
    FP4GenError for any other value."""
    value = os.environ.get(LAYER_GRAPHS_VAR, "1").lower()
    if value not in _SWITCH:
        raise FP4GenError(f"{LAYER_GRAPHS_VAR}={value!r}: expected 1, on, 0 or off")
    return _SWITCH[value]


LAYER_GROUPS_VAR = "FP4GEN_LAYER_GROUPS"


def layer_groups_enabled() -> bool:
    """Whether fp4gen.nn.Linear layers that read one x in a row (q, k and v; gate and up) run as
    one forward and one backward (``FP4GEN_LAYER_GROUPS``: 1/on, the default, or 0/off;
    fp4gen.runtime.layer_groups). FP4GenError for any other value."""
    value = os.environ.get(LAYER_GROUPS_VAR, "1").lower()
    if value not in _SWITCH:
        raise FP4GenError(f"{LAYER_GROUPS_VAR}={value!r}: expected 1, on, 0 or off")
    return _SWITCH[value]


def check_folder_setting(var: str) -> None:
    """FP4GenError when the folder an environment variable names cannot be a path: a NUL byte,
    or a ``~user`` whose home folder is unknown."""
    value = os.environ.get(var)
    if not value:
        return
    if "\0" in value:
        raise FP4GenError(f"{var}={value!r}: a folder name holds no NUL byte")
    if (
        value.startswith("~")
        and os.path.expanduser(value.split(os.sep, 1)[0]) == value.split(os.sep, 1)[0]
    ):
        raise FP4GenError(f"{var}={value}: cannot expand its '~': no home folder for that user")


def check_environment() -> None:
    """FP4GenError for any fp4gen setting in the environment that names no valid value."""
    check_finite_mode()
    layer_graphs_enabled()
    layer_groups_enabled()
    for var in ("FP4GEN_CACHE_DIR", "XDG_CACHE_HOME"):
        check_folder_setting(var)
