"""Non-finite inputs of fp4gen.nn.Linear's quantize paths: raised, or propagated without
stopping the GPU.

Block-scaled formats cannot represent NaN or Inf. ``fp4gen.quantize`` raises TensorError for
such an input, as the reference does: on CUDA one max |x| reduction of the input (NaN propagates
through it, an Inf is the maximum) and one device-to-host read of its result.

That read waits for the GPU. In a training step it would stall the GPU at every quantized
operand (measured on the H100: 7.3 ms instead of 5.2 ms per forward + backward of an 8192 x 8192
layer), which no BF16 layer does. So ``fp4gen.nn.Linear``'s custom ops run in a layer scope
(``layer_scope()``) whose behaviour ``FP4GEN_CHECK_FINITE`` (or ``set_layer_mode``) picks:

* ``propagate`` (default): no read-back. The reduction's flag goes into the quantized operand's
  global scale, which becomes NaN when the input held a NaN or an Inf; every GEMM the operand
  feeds then gives NaN, as a BF16 layer would propagate it, and the usual loss or gradient-norm
  checks (or a GradScaler) see it.
* ``raise``: the flags are read once when the op ends (``deferred()``), after its GEMMs are
  queued, and the op raises TensorError for the first input that held a NaN or an Inf. The
  tensors the layer was given (x, the weight, y's gradient) are checked first
  (``check_given``), so the error names them as the caller shaped them, not a padded or
  transposed operand.

On a CPU (and with the "reference" backend, or on CUDA for a shape the kernels do not take)
the torch reference quantizes, and it raises for a non-finite input. In ``propagate`` the layer
hands it the input with those values zeroed and makes the operand's global scale NaN itself
(``reference_input``, ``poisoned``): the same NaN outputs as the kernels give, on every device.

The generated quantize kernels do the ``propagate`` part themselves: a module exporting
``NONFINITE_TO_NAN_SCALE = True`` (every generated quantize module, rowwise and tile) leaves each
copy's S_dec output NaN if and only if its input held a NaN or an Inf (an RHT copy: also when the
transform overflows), and every output bit unchanged for a finite input, with no extra launch:
with a global scale the amax reduction propagates NaN and a non-finite amax becomes S_dec =
NaN; without one the kernel stores NaN over the 1.0 S_dec that ``launches()`` wrote, from a
NaN-propagating max of the block amaxes (docs/numerics.md section 7). For such modules the
separate reduction, ``isfinite`` and ``poison`` of ``propagate`` are redundant; ``raise`` can
read the S_dec instead of a flag.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fp4gen.errors import FP4GenError
from fp4gen.numerics import QuantizedTensor
from fp4gen.runtime import device_memory
from fp4gen.settings import LAYER_MODES, check_finite_mode

log = logging.getLogger("fp4gen.runtime")
_state = threading.local()  # .pending (deferred reads) and .propagate (flags returned)


def mode_from_env() -> str:
    """The mode ``FP4GEN_CHECK_FINITE`` names (fp4gen.settings: FP4GenError for a bad value)."""
    return check_finite_mode()


# read on first use, not at import: a bad value is reported where a layer runs (or by the CLI
# before any command), never as a traceback out of an import
_layer_mode: list[str | None] = [None]


def layer_mode() -> str:
    """How fp4gen.nn.Linear treats non-finite inputs on CUDA ("propagate" or "raise")."""
    mode = _layer_mode[0]
    if mode is None:
        mode = _layer_mode[0] = mode_from_env()
    return mode


def set_layer_mode(mode: str) -> None:
    """Choose how fp4gen.nn.Linear treats non-finite inputs on CUDA (see the module docstring)."""
    if mode not in LAYER_MODES:
        raise FP4GenError(f"non-finite mode {mode!r}: expected one of {', '.join(LAYER_MODES)}")
    _layer_mode[0] = mode


def _all_finite_flag(x: torch.Tensor) -> torch.Tensor:
    """A 0-dim device bool: whether x holds no NaN or Inf. One reduction, max |x| (NaN
    propagates through torch's max, an Inf is the maximum), and no sync."""
    return torch.isfinite(torch.linalg.vector_norm(x, float("inf")))


def check(x: torch.Tensor, what: str, *args: object) -> torch.Tensor | None:
    """Check x (a CUDA tensor about to be quantized) for NaN and Inf; ``what.format(*args)``
    names it (formatted only when a message is needed: this runs on every quantize call).

    Outside a scope: raises TensorError at once. Inside ``deferred()``: the read waits for the
    end of the block. Inside ``propagating()``: returns the flag, which the caller folds into the
    global scale with ``poison``; otherwise returns None."""
    flag = _all_finite_flag(x)
    if getattr(_state, "propagate", False):
        return flag
    pending = getattr(_state, "pending", None)
    if pending is not None:
        pending.append((flag, x, what, args))
        return None
    if not bool(flag):
        _raise(x, _named(what, args))
    return None


def checks_given() -> bool:
    """Whether ``check_given`` checks here (in a ``deferred()`` block, not propagating)."""
    return getattr(_state, "pending", None) is not None and not getattr(_state, "propagate", False)


def check_given(x: torch.Tensor, what: str, *args: object) -> None:
    """In a ``deferred()`` block (a layer call that raises): check a tensor the caller gave
    before the operands made from it are checked, so that an error names it as the caller
    shaped it, not a padded or transposed operand. Queued on CUDA (read when the block ends),
    read at once on a CPU (no GPU to stall; the reference quantizer would raise first, naming
    its operand). Nothing outside such a block."""
    if not checks_given():
        return
    if x.is_cuda:
        check(x, what, *args)
    elif not bool(_all_finite_flag(x)):
        _raise(x, _named(what, args))


def _named(what: str, args: tuple[object, ...]) -> str:
    """``what`` formatted with ``args``, shapes written as tuples: (2, 3), not torch.Size."""
    return what.format(*(tuple(a) if isinstance(a, torch.Size) else a for a in args))


def propagates() -> bool:
    """Whether non-finite inputs are being propagated here (inside ``propagating()``): a kernel
    that makes its own decode scale NaN for them then needs no separate check."""
    return getattr(_state, "propagate", False)


def poison(global_scale: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor:
    """The global scale, or NaN where ``flag`` says the input was not all finite (no sync)."""
    if flag is None:
        return global_scale
    return torch.where(flag, global_scale, float("nan"))


def reference_input(t: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a layer hands the torch reference quantizer (a CPU tensor, or any tensor with
    ``backend="reference"``) inside ``propagating()``: ``t`` and None, or where ``t`` holds a
    NaN or an Inf, ``t`` with those values zeroed (the reference raises for them) and the
    False flag, which ``poisoned`` folds into the operand's global scale, as the generated
    kernels fold theirs. Elsewhere ``t`` and None: the kernels, or a raising reference."""
    if not getattr(_state, "propagate", False) or (t.is_cuda and backend != "reference"):
        return t, None
    flag = _all_finite_flag(t)
    if bool(flag):  # one read, as the reference makes for its own check
        return t, None
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype)), flag


def poisoned(operand: Any, flag: torch.Tensor | None) -> Any:
    """``operand`` (a quantized operand made from a ``reference_input``), its global scale NaN
    where ``flag`` says the input was not all finite: every GEMM it feeds then gives NaN."""
    if flag is None or not isinstance(operand, QuantizedTensor):
        return operand
    # a fresh result nothing else holds yet: its global scale is set in place
    object.__setattr__(operand, "global_scale", poison(operand.global_scale, flag))
    return operand


def _raise(x: torch.Tensor, what: str) -> None:
    from fp4gen.numerics.quantize import _check_finite

    _check_finite(x, what)  # counts and locates the values, then raises


@contextmanager
def deferred() -> Iterator[None]:
    """Queue the finite checks of the quantize calls in this block and read their results when
    it ends (raising TensorError for the first input that failed). Nested blocks share the
    outermost one's read."""
    if getattr(_state, "pending", None) is not None:
        yield
        return
    _state.pending = pending = []
    try:
        yield
    finally:
        _state.pending = None
    for flag, x, what, args in pending:  # the first read waits for the GPU, the others are done
        if not bool(flag):
            _raise(x, _named(what, args))


@contextmanager
def propagating() -> Iterator[None]:
    """In this block the quantize calls return their finite flags instead of reading them."""
    before = getattr(_state, "propagate", False)
    _state.propagate = True
    try:
        yield
    finally:
        _state.propagate = before


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (False without CUDA)."""
    return torch.cuda.is_available() and device_memory.capturing()


def _capturing_raise_mode() -> bool:
    """In ``raise`` mode, whether this op runs inside a CUDA graph capture (torch.compile's
    reduce-overhead): the end-of-op read cannot run there, so the op propagates instead (a
    NaN global scale, NaN outputs), said once at WARNING."""
    if not _capturing():
        return False
    message = (
        "FP4GEN_CHECK_FINITE=raise cannot be honoured inside a CUDA graph capture (its check "
        "reads the device): non-finite inputs propagate as NaN outputs there"
    )
    if message not in _logged:
        _logged.add(message)
        log.warning(message)
    return True


_logged: set[str] = set()  # the warnings given (once per process)


class layer_scope:  # noqa: N801 (used like the context-manager functions above)
    """The scope of one fp4gen.nn.Linear op, per ``layer_mode()``: ``propagating()`` or
    ``deferred()``. A class rather than a generator: it is entered twice per layer and step."""

    def __enter__(self) -> None:
        if layer_mode() == "propagate" or _capturing_raise_mode():
            self.before = getattr(_state, "propagate", False)
            _state.propagate = True
            self.inner = None
        else:
            self.inner = deferred()
            self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.inner is None:
            _state.propagate = self.before
        else:
            self.inner.__exit__(*exc)


__all__ = [
    "LAYER_MODES",
    "check",
    "check_given",
    "checks_given",
    "deferred",
    "layer_mode",
    "layer_scope",
    "mode_from_env",
    "poison",
    "poisoned",
    "propagates",
    "propagating",
    "reference_input",
    "set_layer_mode",
]
