"""Render a MoR rule into a CuTe DSL module of Mixture-of-Representations kernels (``mor.py.j2``).

A :class:`MoRKernelSpec` is a recipe's ``mor`` rule plus what the operand adds (element rounding,
input dtype). Everything that depends on it is decided here and baked into the generated module
as constants and straight-line code: the candidates and every representation measured (a
``relerr(F)`` yardstick included), each element format's encode constants (derived from its
exponent/mantissa bits, any signed ExMy), the metrics and their thresholds, the scaling method,
and the decision and scale partitions as shifts (``tensor``: 31, ``channel``: rows 0 / columns
31, ``block RxC``: log2 R / log2 C). Shapes stay dynamic.

The generated module's contract (used by ``fp4gen.runtime.mor_kernels``):

* ``KERNELS``: kernel names in launch order: ``("amax", "scales", "quantize")`` when a decision
  unit fits in a 128x128 tile (the decision is taken in the quantizing pass), else
  ``("amax", "scales", "measure", "decide", "emit")`` (a tensor-, channel- or wider decision
  needs every tile's error first: ``decide`` adds the tiles' partial sums and decides);
* ``compile_kernel(name, arch, *, dump_dir=None)``: the TVM-FFI compiled callable of one kernel
  for ``"sm_90a"`` or ``"sm_100a"`` (no GPU needed);
* ``run(fns, x)``: validates ``x`` [R, K], allocates the outputs, launches every kernel (no host
  synchronisation) and returns the tensors a ``MoRTensor`` is made of.

Numerics: docs/numerics.md section 8, bit for bit (the reference is ``fp4gen.numerics.mor``).
"""

from __future__ import annotations

from typing import Any

import torch

from fp4gen.codegen.render import lit, render_template, spec_entries
from fp4gen.dsl.model import MoRSpec, Partition
from fp4gen.formats import ElementFormat, HighPrecision
from fp4gen.numerics.minifloat import max_finite
from fp4gen.numerics.mor import SUM_TILE, representations
from fp4gen.spec import MoRKernelSpec
from fp4gen.vocab import DTYPES, Arch, words

ARCHS: tuple[str, ...] = words(Arch)
ROUNDINGS: tuple[str, ...] = ("nearest", "zero")  # stochastic rounding stays on the reference
SEGMENTS: tuple[int, ...] = (4, 8)  # row segments per thread: 512 or 256 threads (2 spills)
TILE = 128  # a CTA's tile: TILE x TILE elements (must be the reference's SUM_TILE)
WHOLE = 31  # the shift of a partition side that spans the whole tensor (R, K < 2^31)
FLT_MAX = float(torch.finfo(torch.float32).max)


assert TILE == SUM_TILE, "the kernels' tile is the reference's summation piece"


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _shifts(part: Partition, what: str) -> tuple[int, int]:
    """(row shift, column shift): a row's unit index is row >> shift (31: the whole tensor)."""
    if part.kind == "tensor":
        return WHOLE, WHOLE
    if part.kind == "channel":
        return 0, WHOLE
    assert part.block is not None
    rows, cols = part.block
    for side, n in (("rows", rows), ("columns", cols)):
        if n <= 0 or n & (n - 1):
            raise NotImplementedError(
                f"{what} block {rows}x{cols}: the kernels take power-of-two sides ({side} {n})"
            )
    if cols < 8:
        raise NotImplementedError(
            f"{what} block {rows}x{cols}: at least 8 columns (a thread holds 8 along K)"
        )
    return rows.bit_length() - 1, cols.bit_length() - 1


def _element(fmt: ElementFormat, index: int) -> dict[str, Any]:
    if not fmt.signed:
        raise NotImplementedError(f"{fmt.name}: MoR candidates must be signed element formats")
    q_max = max_finite(fmt)
    emin = 1 - fmt.bias
    return {
        "kind": "elem",
        "name": fmt.name,
        "index": index,  # among the element representations (scale buffers)
        "bits": fmt.bits,
        "exp_bits": fmt.exp_bits,
        "man_bits": fmt.man_bits,
        "special": fmt.special,
        "emin_biased": emin + 127,
        "max": lit(q_max),
        "sign_shift": fmt.bits - 1,
        "range_bound": lit(q_max / fmt.min_normal),  # exact: q_max has few significant bits
    }


def check(spec: MoRKernelSpec) -> None:
    """Raise NotImplementedError (with the reason) for a spec the kernels do not cover."""
    rule = spec.rule
    if spec.rounding not in ROUNDINGS:
        raise NotImplementedError(
            f"rounding {spec.rounding!r}: the MoR kernels round {' or '.join(ROUNDINGS)}"
        )
    if spec.input_dtype not in DTYPES:
        raise NotImplementedError(f"input dtype {spec.input_dtype!r}")
    if spec.segments not in SEGMENTS:
        raise NotImplementedError(f"{spec.segments} segments per thread (one of {SEGMENTS})")
    _shifts(rule.decide, "a decision")
    _shifts(rule.scale, "a scale")
    if not any(isinstance(c.format, ElementFormat) for c in rule.candidates):
        raise NotImplementedError("a rule without element candidates (nothing to quantize)")
    for rep in representations(rule):
        if isinstance(rep, ElementFormat) and not rep.signed:
            raise NotImplementedError(f"{rep.name}: MoR candidates must be signed formats")


def context(spec: MoRKernelSpec) -> dict[str, Any]:
    """Everything the template needs, derived from the spec."""
    check(spec)
    rule = spec.rule
    evaluated = representations(rule)
    reps: list[dict[str, Any]] = []
    n_elem = 0
    for i, fmt in enumerate(evaluated):
        if isinstance(fmt, ElementFormat):
            rep = _element(fmt, n_elem)
            n_elem += 1
        else:
            assert isinstance(fmt, HighPrecision)
            rep = {"kind": "hp", "name": fmt.name, "index": None}
        rep["rep"] = i
        reps.append(rep)
    cands = []
    for i, cand in enumerate(rule.candidates):
        rep = reps[evaluated.index(cand.format)]
        metric = cand.metric
        entry: dict[str, Any] = {"index": i, "rep": rep, "metric": None}
        if metric is not None:
            entry["metric"] = metric.kind
            if metric.kind == "relerr":
                assert metric.threshold is not None
                entry["threshold"] = lit(metric.threshold)
                entry["text"] = f"relerr < {metric.threshold!r}"
            elif metric.kind == "relerr_vs":
                assert metric.versus is not None
                entry["versus"] = evaluated.index(metric.versus)
                entry["text"] = f"relerr < relerr({metric.versus.name})"
            else:
                assert isinstance(cand.format, ElementFormat)
                entry["text"] = f"range: max < {rep['range_bound']} * min over non-zeros"
        else:
            entry["text"] = "no other candidate accepts (the fallback)"
        cands.append(entry)
    highs = sorted({c.format.name for c in rule.candidates if isinstance(c.format, HighPrecision)})
    high = highs[0] if len(highs) == 1 else ("fp32" if highs else None)
    urs, ucs = _shifts(rule.decide, "a decision")
    srs, scs = _shifts(rule.scale, "a scale")
    rh, cw = min(urs, 7), min(ucs, 7)
    fused = urs <= 7 and ucs <= 7
    dtype = DTYPES[spec.input_dtype]
    return {
        **spec_entries(spec),
        "rule_text": _rule_text(rule),
        "kernels": ["amax", "scales", "quantize"]
        if fused
        else ["amax", "scales", "measure", "decide", "emit"],
        "fused": fused,
        "archs": list(ARCHS),
        "input": {"name": spec.input_dtype, "cutlass": dtype.cute, "torch": dtype.torch_name},
        "rounding": spec.rounding,
        "reps": reps,
        "elems": [r for r in reps if r["kind"] == "elem"],
        "n_elem": n_elem,
        "cands": cands,
        "n_cands": len(cands),
        "high": None if high is None else {"name": high, "torch": DTYPES[high].torch_name},
        "high_bytes": 0 if high is None else DTYPES[high].size,
        "high_cands": highs,
        "uses_range": any(c["metric"] == "range" for c in cands),
        "scaling": rule.scaling,
        "urs": urs,
        "ucs": ucs,
        "rh": rh,
        "cw": cw,
        "srs": srs,
        "scs": scs,
        "s_rh": min(srs, 7),
        "s_cw": min(scs, 7),
        "upr_shift": min(urs - rh, 24),
        "upc_shift": min(ucs - cw, 24),
        "flt_max": lit(FLT_MAX),
        "segments": spec.segments,
        "log_segments": spec.segments.bit_length() - 1,
    }


def _part_text(part: Partition) -> str:
    if part.kind == "block":
        assert part.block is not None
        return f"block {part.block[0]}x{part.block[1]}"
    return part.kind


def _rule_text(rule: MoRSpec) -> list[str]:
    lines = [f"mor {rule.name}", f"decide {_part_text(rule.decide)}"]
    lines.append(f"scale {_part_text(rule.scale)} {rule.scaling}")
    for c in rule.candidates:
        if c.metric is None:
            lines.append(f"else {c.format.name}")
        elif c.metric.kind == "relerr":
            lines.append(f"try {c.format.name} if relerr < {c.metric.threshold!r}")
        elif c.metric.kind == "relerr_vs":
            assert c.metric.versus is not None
            lines.append(f"try {c.format.name} if relerr < relerr({c.metric.versus.name})")
        else:
            lines.append(f"try {c.format.name} if range")
    return lines


def render(spec: MoRKernelSpec) -> str:
    """The generated CuTe DSL module (Python source) of ``spec``'s MoR kernels.

    Raises NotImplementedError for rules the kernels do not cover (``check``)."""
    return render_template("mor.py.j2", context(spec))


__all__ = ["ARCHS", "ROUNDINGS", "SEGMENTS", "TILE", "MoRKernelSpec", "check", "context", "render"]
