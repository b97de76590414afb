"""``quantize`` and ``mor_quantize`` with a backend: the generated kernels or the oracle.

``fp4gen.quantize`` is ``quantize`` here. Both functions take the arguments of the oracle
(``fp4gen.numerics.quantize.quantize``, ``fp4gen.numerics.mor.mor_quantize``) plus ``backend``:

- ``"reference"`` runs the oracle;
- ``"cute"`` runs the generated CuTe DSL kernels (``fp4gen.runtime.cute_backend.quantize_cute``,
  ``fp4gen.runtime.mor_kernels.mor_quantize_cute``) and raises where they cannot serve the call;
- ``"auto"`` runs the kernels for CUDA tensors (and formats, rules and shapes) they support, else
  the oracle; each reason for falling back is logged once at INFO.

The kernels give the oracle's result bit for bit, so the backend changes the speed, not the
values. The arguments are checked before any kernel is tried, the backend first, then in the
oracle's order (rounding, seed, offset, format, RHT), so a bad argument raises the oracle's error
on every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from fp4gen.dsl.model import MoRSpec, RHTSpec
from fp4gen.errors import ArgumentError, TensorError
from fp4gen.formats import BlockFormat, HighPrecision
from fp4gen.numerics.mor import MoRTensor
from fp4gen.numerics.mor import mor_quantize as reference_mor_quantize
from fp4gen.numerics.quantize import (
    QuantizedTensor,
    _check_call,
    _shown,
    finite_flags,
    resolve_format,
    resolve_rht,
)
from fp4gen.numerics.quantize import quantize as reference_quantize
from fp4gen.runtime import cute_backend, device_memory, finite

BACKENDS: tuple[str, ...] = ("auto", "reference", "cute")


def check_backend(backend: Any) -> str:
    """``backend`` if it is one of BACKENDS, else ArgumentError naming them."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ArgumentError(f"backend must be one of {BACKENDS}, got {_shown(backend)}")
    return backend


def _wants_kernels(backend: str, x: Any) -> bool:
    """Whether to try the kernels: always for "cute", for CUDA tensors with "auto"."""
    return backend == "cute" or (backend == "auto" and isinstance(x, torch.Tensor) and x.is_cuda)


def quantize(
    x: torch.Tensor,
    fmt: BlockFormat | HighPrecision | str,
    *,
    block: tuple[int, int] | None = None,
    rounding: str = "nearest",
    hadamard: int | RHTSpec | None = None,
    seed: int = 0,
    offset: int = 0,
    backend: str = "auto",
) -> QuantizedTensor:
    """Quantize ``x`` to the block-scaled format ``fmt`` with the generated kernels or the oracle.

    The arguments and the result are those of ``fp4gen.numerics.quantize.quantize``, whose
    docstring defines them and the algorithm, bit for bit. ``backend`` picks what runs it:
    "auto" the kernels for CUDA tensors they support, else the oracle (each reason logged once);
    "reference" the oracle; "cute" the kernels, or an error saying why they cannot.

    Not differentiable: ``x`` is detached. Bad arguments raise ``fp4gen.errors.ArgumentError``
    (a ValueError), bad tensors TensorError; both are FP4GenErrors.
    """
    check_backend(backend)
    seed, offset = _check_call(rounding, seed, offset)
    bf = resolve_format(fmt, block)
    spec = resolve_rht(hadamard)
    if isinstance(x, torch.Tensor):
        x = x.detach()  # not differentiable, like the oracle: no graph in the result
    if _wants_kernels(backend, x):
        q = cute_backend.quantize_cute(  # looked up per call, so a test can replace it
            x, bf, rounding=rounding, rht=spec, seed=seed, offset=offset, required=backend == "cute"
        )
        if q is not None:
            return q
    reference = partial(
        reference_quantize, fmt=bf, rounding=rounding, hadamard=spec, seed=seed, offset=offset
    )
    if isinstance(x, torch.Tensor) and capturing(x):
        return _captured_reference(x, reference)
    return reference(x)


capturing = device_memory.captures  # a module attribute: tests stand a capture in here


def _captured_reference(
    x: torch.Tensor, reference: Callable[[torch.Tensor], QuantizedTensor]
) -> QuantizedTensor:
    """The oracle on ``x`` inside a CUDA graph capture (a shape the kernels do not take, in a
    layer graph or torch.compile's reduce-overhead): its finite checks read the device, which a
    capture refuses (the capture then fails, and torch's RNG with it). In a propagating scope
    (fp4gen.nn.Linear's default) NaN and Inf are zeroed and folded into the global scale, as the
    kernels fold them, with no read; elsewhere a TensorError is raised before anything runs."""
    if not finite.propagates():
        raise TensorError(
            f"cannot quantize the input of shape {tuple(x.shape)} with the torch reference inside "
            "a CUDA graph capture: its NaN/Inf check reads the device (the generated kernels do "
            "not take this input; outside a capture, or in a propagating scope, it runs)"
        )
    finite_values = torch.isfinite(x)
    all_finite = finite_values.all()
    with finite_flags() as flags:
        q = reference(x.masked_fill(~finite_values, 0.0))  # no host tensor: a capture
    for flag in flags:  # the transformed input's (an RHT can overflow)
        all_finite = all_finite & flag
    return finite.poisoned(q, all_finite)


def mor_quantize(
    x: torch.Tensor,
    spec: MoRSpec,
    *,
    rounding: str = "nearest",
    hadamard: int | RHTSpec | None = None,
    seed: int = 0,
    offset: int = 0,
    group: tuple[int, int] | None = None,
    backend: str = "auto",
) -> MoRTensor:
    """Quantize ``x`` with the MoR rule ``spec``, with the generated MoR kernels or the oracle.

    The arguments and the result are those of ``fp4gen.numerics.mor.mor_quantize``. ``backend``:
    "auto" the kernels for CUDA tensors and rules they support, else the oracle (each reason
    logged once); "reference" the oracle; "cute" the kernels, or an error saying why they cannot.
    """
    check_backend(backend)
    seed, offset = _check_call(rounding, seed, offset)
    spec_rht = resolve_rht(hadamard)
    if isinstance(x, torch.Tensor):
        x = x.detach()  # not differentiable, like the oracle: no graph in the result
        if capturing(x):
            # raised before any op: a failed capture would leave torch's CUDA generator behind
            raise TensorError(
                f"cannot quantize the input of shape {tuple(x.shape)} with a Mixture-of-"
                "Representations rule inside a CUDA graph capture: the rule's choice of format "
                "reads the device (torch.compile: a mode without CUDA graphs, e.g. 'default')"
            )
    if _wants_kernels(backend, x):
        # loaded here, not with this module: the MoR kernels' module loads Jinja (to render)
        from fp4gen.runtime.mor_kernels import mor_quantize_cute

        mt = mor_quantize_cute(
            x,
            spec,
            rounding=rounding,
            rht=spec_rht,
            seed=seed,
            offset=offset,
            group=group,
            required=backend == "cute",
        )
        if mt is not None:
            return mt
    return reference_mor_quantize(
        x, spec, rounding=rounding, hadamard=spec_rht, seed=seed, offset=offset, group=group
    )


__all__ = ["BACKENDS", "check_backend", "mor_quantize", "quantize"]
