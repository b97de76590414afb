"""Numerics conformance matrix of ``fp4gen.nn.Linear``: every shipped recipe, every GEMM backend
that serves it, every execution mode.

A case is one recipe (``recipes/*.fp4r``; ``fp4gen/recipes`` holds byte copies, checked below;
a recipe with a precision schedule also runs past its last switch, ``@late``), one GEMM backend
of ``fp4gen.gemm`` (``auto`` and each explicit one; the layer's calls to ``fp4gen.gemm`` are
redirected to it where it serves the operand pair, as ``fp4gen.nn.Linear`` itself always asks
for ``auto``), a shape (``aligned``: tokens and features multiples of every block and RHT size;
``ragged``: 37 tokens, 100 in, 52 out, multiples of none), with or without a bias, fp32 / bf16 /
fp16 parameters and inputs, with or without bf16 autocast, and an execution mode: ``eager``,
``layer_groups`` (two layers reading one x, three training steps: the third runs as a group),
``compile`` (``torch.compile``, fullgraph, the ``aot_eager`` backend), ``no_grad`` and
``inference_mode`` (forward only), and on CUDA ``layer_graphs`` (three steps: the third replays
the captured graphs). Every case checks y, dx, dW and db (forward-only modes: y)

(a) against the reference path (quantize backend ``reference``, GEMM backend ``reference``,
    eager, one layer at a time, the same call counts): bit for bit where every GEMM ran on the
    reference, else within the fp32 summation-order bound of docs/numerics.md 6 (and 6.1's
    Hopper adder term for block-scaled FP8), entry by entry;
(b) against plain fp32 math (x W^T + b, dy W, dy^T x, the sum of dy, computed exactly) within
    the conformance bound of docs/numerics.md ("Conformance bound"), in the Frobenius norm:
    ||F - E|| <= sqrt(V) + ||D||, V the expected squared error of the quantized GEMM from the
    operand formats (element mantissa bits, block amax, scale rounding, RHT), D the
    deterministic part (SR bias, fp32 sums, output rounding). Correct cases measure 0.36 to
    0.75 of it.

The bias is drawn about twice as large as x W^T, so that dropping it is a 2 ||x W^T|| error.
Measured on the CPU matrix, a dropped bias gives 8.6x (MXFP4) to 9.4x (NVFP4), 18x (E3M2,
3-way MoR) and 39x (FP8, MXFP8, 2-way MoR) the bound; every case asserts at least
``MIN_MARGIN``. The fault tests inject a dropped or doubled bias, a global scale applied twice,
a missing bias gradient and missing gradient terms (monkeypatch) and check that the matrix
reports each (their docstrings give the ratios measured).

CPU (about 80 s on two cores): recipe x GEMM backend x shape x mode fully crossed (where the
backend serves a GEMM of the recipe); bias, dtype and autocast chosen so that every pair of
values of any two dimensions occurs (all-pairs, ``covering``). GPU (marker ``gpu``, skipped
without CUDA): the full cross product over the recipes with distinct numerics (the nvfp4
ablations of layer rules only, which a Linear does not read, run once), backends skipped where
they serve no GEMM of the recipe; and ``torch.compile`` with inductor once per recipe and
backend (db then within its sum's bound: inductor may sum dy in another order).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fp4gen
import fp4gen.gemm_dispatch as gd
from fp4gen.compiler.plan import ROW_SCALED_REASON
from fp4gen.dsl.model import MoRRef, MoRSpec, OperandSpec, OperandTable, Recipe
from fp4gen.formats import BlockFormat, ElementFormat, HighPrecision, ScaleSpec, sr_bits
from fp4gen.numerics.hadamard import rht_matrix
from fp4gen.runtime import epilogue, layer_groups, linear, ops
from fp4gen.settings import LAYER_GRAPHS_VAR, LAYER_GROUPS_VAR

ROOT = Path(__file__).resolve().parent.parent
U32 = 2.0**-24  # fp32's unit roundoff
UNIT = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HP = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # format names
SHAPES = {"aligned": (128, 256, 128), "ragged": (37, 100, 52)}  # tokens, in, out
CPU_BACKENDS = ("auto", "reference", "dequant", "block_scaled")
GPU_BACKENDS = ("auto", "reference", "dequant", "cute", "block_scaled", "blackwell")
CPU_MODES = ("eager", "layer_groups", "compile", "no_grad", "inference_mode")
CPU_CROSSED = ("recipe", "backend", "shape", "mode")  # fully crossed on CPU; the rest all-pairs
GPU_MODES = (*CPU_MODES, "layer_graphs")
STEPS = {"layer_groups": 3, "layer_graphs": 3}  # the last step is the one checked; others: 1
MEMBERS = {"layer_groups": 2}  # layers reading one x; others: 1
TC_REL = 4 * 33 * 2.0**-13  # Hopper's FP8 adder per K-block (numerics.md 6.1, "Hopper")
MIN_MARGIN = 6.0  # a dropped bias must give at least this many times the bound
LATE_STEP = 99  # of 100: past every switch of a precision schedule


# ----------------------------------------------------------------------------------------------
# The recipes and what serves their GEMMs
# ----------------------------------------------------------------------------------------------
def shipped_recipes() -> list[Path]:
    return sorted((ROOT / "recipes").glob("*.fp4r"))


@dataclass(frozen=True)
class RecipeCase:
    """A shipped recipe at a training step (``@late``: past its schedule's switches)."""

    name: str
    path: Path
    step: int

    def load(self) -> Recipe:
        return _loaded(self.path)

    def table(self) -> OperandTable:
        layer = fp4gen.nn.Linear(16, 16, recipe=self.load(), device="meta")
        fp4gen.set_step(layer, self.step, total_steps=100)
        return layer.operands


_recipes: dict[Path, Recipe] = {}


def _loaded(path: Path) -> Recipe:
    if path not in _recipes:
        _recipes[path] = fp4gen.load_recipe(path)
    return _recipes[path]


def recipe_cases() -> list[RecipeCase]:
    cases = []
    for path in shipped_recipes():
        cases.append(RecipeCase(path.stem, path, 0))
        if _loaded(path).schedule:
            cases.append(RecipeCase(f"{path.stem}@late", path, LATE_STEP))
    return cases


RECIPE_CASES = {r.name: r for r in recipe_cases()}
Op = fp4gen.Operand
GEMMS = (
    ("fprop", Op.FPROP_ACTIVATION, Op.FPROP_WEIGHT),
    ("dgrad", Op.DGRAD_GRADIENT, Op.DGRAD_WEIGHT),
    ("wgrad", Op.WGRAD_GRADIENT, Op.WGRAD_ACTIVATION),
)


def not_served(backend: str, fa: object, fb: object, device: str, arch: str | None) -> str | None:
    """Why ``backend`` cannot run the GEMM of formats (fa, fb) here, or None."""
    from fp4gen.codegen.gemm_configs import FUSED_ARCHS, NATIVE_ARCHS, mma_plan
    from fp4gen.runtime import fp8_gemm

    if backend == "auto":
        return None
    if not (isinstance(fa, BlockFormat) and isinstance(fb, BlockFormat)):
        return "not two block formats (the layer multiplies MoR and high precision itself)"
    if backend in ("reference", "dequant"):
        return None
    if device != "cuda":  # on CPU tensors block_scaled is its float64 oracle
        return None if backend == "block_scaled" else "a CUDA kernel"
    if backend == "cute":
        if fa.global_rows or fb.global_rows:  # gemm(backend="cute") refuses them (numerics.md 11.4)
            return ROW_SCALED_REASON
        return gd.fused_support(fa, fb) or (None if arch in FUSED_ARCHS else f"not {FUSED_ARCHS}")
    if backend == "block_scaled":
        return fp8_gemm.support(fa, fb) or fp8_gemm.torch_reason() or fp8_gemm.arch_reason(arch)
    plan = mma_plan(fa, fb)
    return plan if isinstance(plan, str) else (None if arch in NATIVE_ARCHS else "not sm_100a")


def serves_any(backend: str, recipe: RecipeCase, device: str, arch: str | None) -> bool:
    table = recipe.table()
    return any(
        not_served(backend, table[a].format, table[b].format, device, arch) is None
        for _, a, b in GEMMS
    )


# ----------------------------------------------------------------------------------------------
# The matrix
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    recipe: str
    backend: str
    shape: str
    bias: bool
    dtype: str
    autocast: bool
    mode: str
    device: str = "cpu"

    @property
    def id(self) -> str:
        bias = "bias" if self.bias else "nobias"
        cast = "autocast" if self.autocast else "plain"
        return "-".join(
            (self.device, self.recipe, self.backend, self.shape, bias, self.dtype, cast, self.mode)
        )

    @property
    def trains(self) -> bool:
        return self.mode not in ("no_grad", "inference_mode")


def covering(
    axes: dict[str, Sequence[Any]], full: Sequence[str], allowed: Callable[[dict], bool]
) -> list[dict[str, Any]]:
    """Every allowed combination of the axes named in ``full``, each completed with values of
    the other axes, plus cases as needed, so that every pair of values of any two axes (other
    than two ``full`` ones, crossed already) occurs in some case. Greedy and deterministic."""
    names = list(axes)
    rest = [n for n in names if n not in full]
    uncovered = {
        ((n1, v1), (n2, v2))
        for n1, n2 in itertools.combinations(names, 2)
        if not (n1 in full and n2 in full)
        for v1 in axes[n1]
        for v2 in axes[n2]
    }
    bases = [
        dict(zip(full, values, strict=True))
        for values in itertools.product(*(axes[n] for n in full))
    ]
    bases = [b for b in bases if allowed(b)]

    def pairs(case: dict[str, Any]) -> set:
        items = [(n, case[n]) for n in names if n in case]
        return {(p, q) for p, q in itertools.combinations(items, 2)}

    def complete(case: dict[str, Any]) -> dict[str, Any]:
        for n in rest:
            if n not in case:
                case[n] = max(axes[n], key=lambda v: len(pairs({**case, n: v}) & uncovered))
        return case

    cases = []
    for base in bases:
        case = complete(dict(base))
        uncovered.difference_update(pairs(case))
        cases.append(case)
    while uncovered:  # pairs of two completed axes the bases did not meet
        (n1, v1), (n2, v2) = min(uncovered, key=repr)
        start = {n1: v1, n2: v2}
        fits = [b for b in bases if all(start.get(n, v) == v for n, v in b.items())]
        base = max(fits, key=lambda b: len(pairs({**b, **start}) & uncovered))
        case = complete({**base, **start})
        uncovered.difference_update(pairs(case))
        cases.append(case)
    return cases


def cpu_cases() -> list[Case]:
    axes: dict[str, Sequence[Any]] = {
        "recipe": list(RECIPE_CASES),
        "backend": CPU_BACKENDS,
        "shape": list(SHAPES),
        "bias": (True, False),
        "dtype": list(DTYPES),
        "autocast": (False, True),
        "mode": CPU_MODES,
    }

    def allowed(base: dict) -> bool:
        return serves_any(base["backend"], RECIPE_CASES[base["recipe"]], "cpu", None)

    return [Case(**c) for c in covering(axes, CPU_CROSSED, allowed)]


def distinct_numerics() -> list[str]:
    """The recipe cases whose Linears compute different things: one per operand table and MoR
    rules (the nvfp4 ablations of layer rules only are one)."""
    seen: dict[tuple, str] = {}
    for name, recipe in RECIPE_CASES.items():
        seen.setdefault((recipe.table(), recipe.load().mors), name)
    return list(seen.values())


def gpu_cases() -> list[Case]:
    return [
        Case(*values, device="cuda")
        for values in itertools.product(
            distinct_numerics(), GPU_BACKENDS, SHAPES, (True, False), DTYPES, (False, True),
            GPU_MODES,
        )
    ]  # fmt: skip


def inductor_cases() -> list[Case]:
    """torch.compile with inductor (the default backend; a compile each, so one case per
    recipe and backend): y, dx, dW in the custom ops as eagerly, db within its sum's bound."""
    return [
        Case(recipe, backend, "ragged", True, "bf16", False, "compile_inductor", "cuda")
        for recipe in distinct_numerics()
        for backend in GPU_BACKENDS
    ]


ON_GPU = torch.cuda.is_available()
CPU_CASES = cpu_cases()
GPU_CASES = gpu_cases() if ON_GPU else []
INDUCTOR_CASES = inductor_cases() if ON_GPU else []


# ----------------------------------------------------------------------------------------------
# Running a case
# ----------------------------------------------------------------------------------------------
@dataclass
class Data:
    """One case's tensors: x [T, in], and per layer W [out, in], b [out] and dy [T, out]."""

    x: torch.Tensor
    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    dys: list[torch.Tensor]


def make_data(case: Case, members: int) -> Data:
    """Gaussian x and dy, W with nn.Linear's scale, and a bias about twice as large as x W^T
    (rounded to the case's dtype; dy to the output's)."""
    tokens, n_in, n_out = SHAPES[case.shape]
    dtype = DTYPES[case.dtype]
    out_dtype = torch.bfloat16 if case.autocast else dtype
    g = torch.Generator().manual_seed(tokens * 1000 + n_in)
    x = torch.randn(tokens, n_in, generator=g).to(dtype)
    weights, biases, dys = [], [], []
    for _ in range(members):
        w = (torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in)).to(dtype)
        rms = float((x.double() @ w.double().t()).pow(2).mean().sqrt())
        b = (torch.randn(n_out, generator=g) * 2 * rms).to(dtype) if case.bias else None
        weights.append(w)
        biases.append(b)
        dys.append(torch.randn(tokens, n_out, generator=g).to(out_dtype))
    to = case.device
    return Data(
        x.to(to),
        [w.to(to) for w in weights],
        [None if b is None else b.to(to) for b in biases],
        [dy.to(to) for dy in dys],
    )


@dataclass
class Run:
    """What a case computed at its last step: per layer y, dW, db, and dx (summed over the
    layers); ``ran``: the GEMM backend of every ``fp4gen.gemm`` call; ``grouped``: whether the
    layers ran as a group."""

    ys: list[torch.Tensor]
    dx: torch.Tensor | None
    dws: list[torch.Tensor | None]
    dbs: list[torch.Tensor | None]
    ran: set[str] = field(default_factory=set)
    grouped: bool = False


@contextmanager
def environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def gemm_backend(backend: str, ran: set[str]) -> Iterator[None]:
    """The layer's ``fp4gen.gemm`` calls run on ``backend`` where it serves the pair (else on
    auto); ``ran`` collects the backend each call ran on."""
    real = linear.gemm
    arch = None

    def redirected(a: Any, b: Any, **kw: Any) -> torch.Tensor:
        nonlocal arch
        device = a.device.type
        if device == "cuda" and arch is None:
            from fp4gen.compiler.jit import detect_arch

            arch = detect_arch(a.device)
        chosen = backend
        if not_served(backend, a.format, b.format, device, arch) is not None:
            chosen = "auto"
        ran.add(gd.auto_backend(a, b).backend if chosen == "auto" else chosen)
        return real(a, b, backend=chosen, **kw)

    linear.gemm = redirected  # type: ignore[assignment]
    try:
        yield
    finally:
        linear.gemm = real  # type: ignore[assignment]


class Siblings(nn.Module):
    """Layers that read one x (a block's q, k and v)."""

    def __init__(self, layers: list[fp4gen.nn.Linear]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(layer(x) for layer in self.layers)


def run_case(case: Case, data: Data, *, reference: bool) -> Run:
    """The case's last step; ``reference``: the reference path of the same case."""
    recipe = RECIPE_CASES[case.recipe]
    members = len(data.weights)
    layers = []
    for j in range(members):
        layer = fp4gen.nn.Linear(
            *data.weights[j].shape[::-1],
            bias=case.bias,
            device=case.device,
            dtype=DTYPES[case.dtype],
            recipe=recipe.load(),
            seed=11 + j,
            name=f"layer{j}",
            backend="reference" if reference else "auto",
        )
        with torch.no_grad():
            layer.weight.copy_(data.weights[j])
            if layer.bias is not None:
                layer.bias.copy_(data.biases[j])
        layers.append(layer)
    model: nn.Module = Siblings(layers)
    fp4gen.set_step(model, recipe.step, total_steps=100)
    mode = "eager" if reference else case.mode
    if mode in ("compile", "compile_inductor"):
        torch._dynamo.reset()
        backend = "inductor" if mode == "compile_inductor" else "aot_eager"
        model = torch.compile(model, backend=backend, fullgraph=True)
    grad_mode = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        case.mode, nullcontext
    )
    autocast = torch.autocast(case.device, dtype=torch.bfloat16, enabled=case.autocast)
    ran: set[str] = set()
    env = {
        LAYER_GROUPS_VAR: "1" if mode == "layer_groups" else "0",
        LAYER_GRAPHS_VAR: "1" if mode == "layer_graphs" else "0",
    }
    with environment(**env), gemm_backend("reference" if reference else case.backend, ran):
        for _ in range(STEPS.get(case.mode, 1)):
            for layer in layers:
                layer.weight.grad = None
                if layer.bias is not None:
                    layer.bias.grad = None
            x = data.x.clone().requires_grad_(case.trains)
            with grad_mode(), autocast:
                ys = model(x)
            if case.trains:
                torch.autograd.backward(list(ys), list(data.dys))
    grouped = layer_groups.group_of(layers[0]) is not None
    return Run(
        [y.detach().clone() for y in ys],
        x.grad if case.trains else None,
        [layer.weight.grad for layer in layers],
        [None if layer.bias is None else layer.bias.grad for layer in layers],
        ran,
        grouped,
    )


_references: dict[tuple, Run] = {}


def reference_run(case: Case, data: Data) -> Run:
    """The reference path of ``case`` (kept: several cases share one)."""
    key = (
        case.recipe, case.shape, case.bias, case.dtype, case.autocast, case.device,
        case.trains, len(data.weights), STEPS.get(case.mode, 1),
    )  # fmt: skip
    if key not in _references:
        _references[key] = run_case(case, data, reference=True)
    return _references[key]


# ----------------------------------------------------------------------------------------------
# The conformance bound (docs/numerics.md, "Conformance bound")
# ----------------------------------------------------------------------------------------------
@dataclass
class ErrorModel:
    """An operand [R, K'] as its GEMM multiplies it (K zero-padded, rotated where it has an
    RHT; float64) and per element: ``spread`` the rms of its rounding error under the model of
    docs/numerics.md ("Conformance bound"), ``drift`` a bound on its mean (stochastic rounding
    with few random bits, round toward zero) and ``step`` on its magnitude."""

    values: torch.Tensor
    spread: torch.Tensor
    drift: torch.Tensor
    step: torch.Tensor


# rms of a rounding error per half grid step h: uniform on [-h, h] to nearest; stochastic
# rounding's p (1 - p) (2h)^2 averaged over a uniform fraction; toward zero uniform on [0, 2h)
# about its mean h
RMS_PER_HALF_STEP = {"nearest": 1 / math.sqrt(3), "stochastic": math.sqrt(2 / 3)}


def scale_slack(scale: ScaleSpec) -> tuple[float, float]:
    """(up, down): a block's decode scale s_b S_dec is at most ``up`` * amax_b / elem_max and at
    least that / ``down`` (the scale format's rounding; fp32 roundings of S_enc and d_b)."""
    fp32 = 1 + 2.0**-20
    element = scale.element
    if element is None:
        return fp32, fp32
    if element.exponent_only:
        slack = {"up": (2.0, 1.0), "down": (1.0, 2.0), "nearest": (4 / 3, 1.5)}
        up, down = slack.get(scale.rounding, (2.0, 2.0))  # ocp: a power of two below
    else:
        step = 2.0**-element.man_bits
        slack = {"up": (1 + step, 1.0), "down": (1.0, 1 + step)}
        up, down = slack.get(scale.rounding, (1 + step / 2, 1 + step / 2))
    return up * fp32, down * fp32


def block_amax(mag: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each element's block amax (|values| given), the edge blocks zero-padded."""
    rows, cols = mag.shape
    br, bc = block
    pr, pc = -(-rows // br) * br, -(-cols // bc) * bc
    padded = torch.nn.functional.pad(mag, (0, pc - cols, 0, pr - rows))
    tiles = padded.view(pr // br, br, pc // bc, bc).amax(dim=(1, 3), keepdim=True)
    return tiles.expand(-1, br, -1, bc).reshape(pr, pc)[:rows, :cols]


def element_spread(
    mag: torch.Tensor, element: ElementFormat, floor_scale: torch.Tensor | float, down: float
) -> torch.Tensor:
    """Half a grid step at each |value| (relative 2^-(m+1) in the normal range, 2^(emin-m-1)
    decode steps below it), or the saturation error where the scale rounded down."""
    m = element.man_bits
    emin = math.log2(element.min_normal)
    normal = 2.0 ** -(m + 1) * mag
    saturated = (1 - 1 / down) * mag
    floor = 2.0 ** (emin - m - 1) * floor_scale
    return torch.maximum(torch.maximum(normal, saturated), torch.as_tensor(floor) * 1.0)


def error_model(t: torch.Tensor, spec: OperandSpec, mors: dict[str, MoRSpec], k: int) -> ErrorModel:
    """The error model of operand ``t`` [R, K] (float64, K zero-padded to ``k``) under
    ``spec``."""
    t = torch.nn.functional.pad(t, (0, k - t.shape[1]))
    fmt = spec.format
    zero = torch.zeros_like(t)
    near = RMS_PER_HALF_STEP["nearest"]
    if isinstance(fmt, HighPrecision):
        half = UNIT[HP[fmt.name]] * t.abs()
        return ErrorModel(t, near * half, zero, half)
    extra = zero
    if spec.rht is not None:  # x H per chunk, then rounded to bf16 (numerics.md 4)
        d = spec.rht.size
        h = rht_matrix(spec.rht).to(t.device)
        t = (t.reshape(t.shape[0], -1, d) @ h).reshape(t.shape)
        extra = 2.0**-8 * t.abs()
    mag = t.abs() + extra
    if isinstance(fmt, MoRRef):
        # the worst candidate; GAM / amax scales never saturate, and decode a unit with at most
        # twice its amax / q_max (the tensor's amax bounds every unit's)
        half = zero
        for candidate in mors[fmt.name].candidates:
            c = candidate.format
            if isinstance(c, HighPrecision):
                one = UNIT[HP[c.name]] * mag
            else:
                one = element_spread(mag, c, 2 * mag.max() / c.max_finite, 1.0)
            half = torch.maximum(half, one)
    else:
        assert isinstance(fmt, BlockFormat)
        up, down = scale_slack(fmt.scale)
        amax = block_amax(mag, fmt.block)
        half = element_spread(mag, fmt.element, up * amax / fmt.element.max_finite, down)
    bits = sr_bits(spec.rounding)
    if spec.rounding == "zero":  # a whole grid step, always toward zero
        spread, drift, step = near * half, half, 2 * half
    elif bits:  # P(up) is t / 2^bits: at most 2^-bits of a step toward zero
        spread = RMS_PER_HALF_STEP["stochastic"] * half
        drift, step = 2.0**-bits * 2 * half, 2 * half
    else:
        spread, drift, step = near * half, zero, half
    return ErrorModel(t, spread + near * extra, drift, step + extra)


@dataclass
class GemmBound:
    """One GEMM's bound: ``variance`` bounds E ||C_q - C||_F^2, ``fixed`` [M, N] the
    deterministic error, ``magnitude`` [M, N] bounds sum_k |a_q b_q| (the summation-order
    bound's scale), ``exact`` [M, N] the product of the unquantized operands."""

    variance: float
    fixed: torch.Tensor
    magnitude: torch.Tensor
    exact: torch.Tensor


def gemm_bound(a: ErrorModel, b: ErrorModel) -> GemmBound:
    sa, sb = a.spread.square(), b.spread.square()
    va, vb = a.values.square(), b.values.square()
    variance = float((sa.sum(0) * vb.sum(0) + va.sum(0) * sb.sum(0) + sa.sum(0) * sb.sum(0)).sum())
    abs_a, abs_b = a.values.abs(), b.values.abs()
    magnitude = (abs_a + a.step) @ (abs_b + b.step).t()
    fixed = a.drift @ abs_b.t() + abs_a @ b.drift.t() + a.drift @ b.drift.t()
    fixed = fixed + (a.values.shape[1] + 8) * U32 * magnitude  # the fp32 sums and epilogue
    return GemmBound(variance, fixed, magnitude, a.values @ b.values.t())


def lcm_k(a: OperandSpec, b: OperandSpec) -> int:
    """A K multiple both operands' blocks and RHTs divide (zero padding is exact)."""
    units = []
    for spec in (a, b):
        units.append(1 if spec.rht is None else spec.rht.size)
        if isinstance(spec.format, BlockFormat):
            units.append(spec.format.block_len)
    return math.lcm(*units)


@dataclass
class Check:
    """One comparison: ``ratio`` is error / bound (at most 1 passes; an exact comparison that
    fails is inf); ``margin`` what a dropped bias would give (y with a bias, against fp32)."""

    tensor: str
    against: str
    ratio: float
    margin: float | None = None

    def __str__(self) -> str:
        extra = "" if self.margin is None else f", dropped bias x{self.margin:.3g}"
        return f"{self.tensor} vs {self.against}: x{self.ratio:.3g} the bound{extra}"


def checks(case: Case, data: Data, got: Run, ref: Run) -> list[Check]:
    """Every comparison of ``got`` (the case) with the reference path ``ref`` (a) and with
    plain fp32 math (b)."""
    recipe = RECIPE_CASES[case.recipe]
    table, mors = recipe.table(), {m.name: m for m in recipe.load().mors}
    x = data.x.double()
    out_dtype = torch.bfloat16 if case.autocast else DTYPES[case.dtype]
    # the GEMMs are bit for bit the reference's where every one ran on the reference
    exact = got.ran <= {"reference"}
    adder = TC_REL if case.device == "cuda" and "block_scaled" in got.ran else 0.0
    found: list[Check] = []

    def bound_of(name: str, w: torch.Tensor, dy: torch.Tensor) -> GemmBound:
        operands = {
            "fprop": (x, w),
            "dgrad": (dy, w.t()),
            "wgrad": (dy.t(), x.t()),
        }[name]
        _, op_a, op_b = next(g for g in GEMMS if g[0] == name)
        spec_a, spec_b = table[op_a], table[op_b]
        k = -(-operands[0].shape[1] // lcm_k(spec_a, spec_b)) * lcm_k(spec_a, spec_b)
        a = error_model(operands[0].contiguous(), spec_a, mors, k)
        b = error_model(operands[1].contiguous(), spec_b, mors, k)
        return gemm_bound(a, b)

    def compare(
        name: str,
        tensor: torch.Tensor,
        reference: torch.Tensor,
        bounds: list[GemmBound],
        shift: torch.Tensor | None,
        unit: float,
        sums: int = 0,
    ) -> None:
        rows, cols = tensor.shape
        crop = [(bd.fixed[:rows, :cols], bd.magnitude[:rows, :cols]) for bd in bounds]
        f, r = tensor.double(), reference.double()
        # (a) the reference path
        if exact:
            ratio = 0.0 if torch.equal(tensor, reference) else math.inf
        else:
            c = (2 * (max(bd.exact.shape[1] for bd in bounds) + 8) * U32 + adder) + 2 * unit * sums
            limit = sum(c * mag for _, mag in crop) + unit * (f.abs() + r.abs()) / (1 - unit)
            ratio = float(((f - r).abs() / limit.clamp_min(1e-300)).max())
        found.append(Check(name, "reference", ratio))
        # (b) plain fp32 math
        exact_value = sum(bd.exact[:rows, :cols] for bd in bounds)
        if shift is not None:
            exact_value = exact_value + shift
        fixed = sum(fx for fx, _ in crop) + (unit * (1 + sums) + 8 * U32) * exact_value.abs()
        bound = math.sqrt(sum(bd.variance for bd in bounds)) + float(fixed.norm())
        ratio = float((f - exact_value).norm()) / bound
        margin = None
        if shift is not None:
            margin = float((f - shift - exact_value).norm()) / bound
        found.append(Check(name, "fp32", ratio, margin))

    members = len(data.weights)
    dx_bounds = []
    for j in range(members):
        w, dy = data.weights[j].double(), data.dys[j].double()
        b = data.biases[j]
        y_unit = UNIT[out_dtype]
        shift = None if b is None else b.double()
        compare(f"y[{j}]", got.ys[j].reshape(-1, w.shape[0]), ref.ys[j].reshape(-1, w.shape[0]),
                [bound_of("fprop", w, dy)], shift, y_unit)  # fmt: skip
        if not case.trains:
            continue
        dx_bounds.append(bound_of("dgrad", w, dy))
        dw, dw_ref = got.dws[j], ref.dws[j]
        assert dw is not None and dw_ref is not None and dw.dtype == dw_ref.dtype
        compare(f"dW[{j}]", dw, dw_ref, [bound_of("wgrad", w, dy)], None, UNIT[dw.dtype])
        db, db_ref = got.dbs[j], ref.dbs[j]
        if b is None:
            assert db is None and db_ref is None
            continue
        assert db is not None and db_ref is not None
        want = dy.sum(0)
        limit = dy.shape[0] * U32 * dy.abs().sum(0) + UNIT[db.dtype] * want.abs()
        if case.mode == "compile_inductor":  # inductor may sum dy in another order
            diff = (db.double() - db_ref.double()).abs()
            slack = UNIT[db.dtype] * (db.double().abs() + db_ref.double().abs()) + 2 * limit
            found.append(Check(f"db[{j}]", "reference", float((diff / slack).max())))
        else:
            same = torch.equal(db, db_ref)
            found.append(Check(f"db[{j}]", "reference", 0.0 if same else math.inf))
        ratio = float(((db.double() - want).abs() / limit.clamp_min(1e-300)).max())
        found.append(Check(f"db[{j}]", "fp32", ratio))
    if case.trains:
        assert got.dx is not None and ref.dx is not None and got.dx.dtype == ref.dx.dtype
        compare("dx", got.dx, ref.dx, dx_bounds, None, UNIT[got.dx.dtype], sums=members - 1)
    return found


def run_and_check(case: Case) -> tuple[Run, list[Check]]:
    data = make_data(case, MEMBERS.get(case.mode, 1))
    ref = reference_run(case, data)
    got = run_case(case, data, reference=False)
    return got, checks(case, data, got, ref)


def assert_conforms(case: Case) -> None:
    got, found = run_and_check(case)
    failed = [str(c) for c in found if not c.ratio <= 1.0]
    assert not failed, f"{case.id}: " + "; ".join(failed)
    narrow = [str(c) for c in found if c.margin is not None and c.margin < MIN_MARGIN]
    assert not narrow, f"{case.id}: a dropped bias is within {MIN_MARGIN}x: {narrow}"
    if case.mode == "layer_groups":
        assert got.grouped == groups_form(case), case.id


def groups_form(case: Case) -> bool:
    """Whether the layers of a layer_groups case run as a group (layer_groups._fit): a kept
    wgrad copy (a block format rounded to nearest, with the same transform for every layer: not
    signs drawn per layer or step), no MoR operand, no SR in the forward."""
    table = RECIPE_CASES[case.recipe].table()
    wgrad_x = table[Op.WGRAD_ACTIVATION]
    return (
        isinstance(wgrad_x.format, BlockFormat)
        and sr_bits(wgrad_x.rounding) == 0
        and not (wgrad_x.rht is not None and wgrad_x.rht.redrawn)
        and not any(isinstance(spec.format, MoRRef) for _, spec in table.items())
        and sr_bits(table[Op.FPROP_ACTIVATION].rounding) == 0
        and sr_bits(table[Op.FPROP_WEIGHT].rounding) == 0
    )


# ----------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One CPU thread per case: the GEMMs are small, and a busy machine's idle threads spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_package_copies_are_the_shipped_recipes() -> None:
    """fp4gen/recipes holds byte copies of recipes/: the matrix runs each once."""
    for path in shipped_recipes():
        copy = ROOT / "fp4gen" / "recipes" / path.name
        assert (
            hashlib.sha256(copy.read_bytes()).digest() == hashlib.sha256(path.read_bytes()).digest()
        ), path.name
    assert {p.name for p in (ROOT / "fp4gen" / "recipes").glob("*.fp4r")} == {
        p.name for p in shipped_recipes()
    }


def test_the_cpu_matrix_covers_every_pair() -> None:
    """recipe x backend x shape x mode fully crossed (where the backend serves a GEMM of the
    recipe), and every pair of values of any two dimensions in some case."""
    seen = {(c.recipe, c.backend, c.shape, c.mode) for c in CPU_CASES}
    for r, b, s, m in itertools.product(RECIPE_CASES, CPU_BACKENDS, SHAPES, CPU_MODES):
        assert ((r, b, s, m) in seen) == serves_any(b, RECIPE_CASES[r], "cpu", None)
    rows = [vars(c) for c in CPU_CASES]
    names = ["recipe", "backend", "shape", "mode", "bias", "dtype", "autocast"]
    values = {n: {row[n] for row in rows} for n in names}
    assert values["mode"] == set(CPU_MODES) and values["dtype"] == set(DTYPES)
    for n1, n2 in itertools.combinations(names, 2):
        if n1 in CPU_CROSSED and n2 in CPU_CROSSED:
            continue
        pairs = {(row[n1], row[n2]) for row in rows}
        assert pairs == set(itertools.product(values[n1], values[n2])), (n1, n2)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_conformance_cpu(case: Case) -> None:
    assert_conforms(case)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_conformance_gpu(case: Case) -> None:
    from fp4gen.compiler.jit import detect_arch

    recipe = RECIPE_CASES[case.recipe]
    if not serves_any(case.backend, recipe, "cuda", detect_arch()):
        pytest.skip(f"{case.backend} serves no GEMM of {case.recipe} here")
    assert_conforms(case)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("case", INDUCTOR_CASES, ids=lambda c: c.id)
def test_conformance_gpu_inductor(case: Case) -> None:
    test_conformance_gpu(case)


# ----------------------------------------------------------------------------------------------
# Faults the matrix must catch
# ----------------------------------------------------------------------------------------------
def faulty(case: Case, inject: Callable[[], None]) -> dict[tuple[str, str], Check]:
    """The case's checks with a fault injected after its reference path ran."""
    data = make_data(case, MEMBERS.get(case.mode, 1))
    ref = reference_run(case, data)
    inject()
    got = run_case(case, data, reference=False)
    return {(c.tensor, c.against): c for c in checks(case, data, got, ref)}


BASE = {
    "bias": True, "dtype": "fp32", "autocast": False, "mode": "eager", "shape": "ragged",
}  # fmt: skip


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8_blockwise", "mxfp4"])
@pytest.mark.parametrize("fault", ["dropped", "doubled"])
def test_a_dropped_or_doubled_bias_fails(monkeypatch, recipe: str, fault: str) -> None:
    """The epilogue drops or doubles the bias: y fails the fp32 bound by a wide margin (and the
    reference path, which ran before the fault)."""
    case = Case(recipe, "auto", **BASE)
    real = epilogue.apply_steps

    def broken(c, alpha, bias, accumulate, out_dtype):
        bias = None if fault == "dropped" or bias is None else 2 * bias
        return real(c, alpha, bias, accumulate, out_dtype)

    found = faulty(case, lambda: monkeypatch.setattr(epilogue, "apply_steps", broken))
    assert found[("y[0]", "fp32")].ratio >= MIN_MARGIN, found[("y[0]", "fp32")]
    assert found[("y[0]", "reference")].ratio > 1
    assert found[("dx", "fp32")].ratio <= 1 and found[("dW[0]", "fp32")].ratio <= 1


@pytest.mark.parametrize(("recipe", "least"), [("nvfp4", 3.0), ("exotic_e3m2_b8", 6.0)])
def test_a_global_scale_applied_twice_fails(monkeypatch, recipe: str, least: float) -> None:
    """S_dec(A) S_dec(B) applied twice on the dequant backend (the reference applies the scales
    inside its product): y, dx and dW fail the fp32 bound (measured: NVFP4 4.8x, 3.7x, 3.9x;
    E3M2 9.9x, 7.9x, 8.0x: the whole product lost is 1 / its relative bound) and the reference
    path by far. Formats without a global scale (S_dec = 1) cannot show this fault."""
    case = Case(recipe, "dequant", **BASE)
    real = epilogue._alpha
    twice = lambda a, b, device: real(a, b, device) ** 2  # noqa: E731
    found = faulty(case, lambda: monkeypatch.setattr(epilogue, "_alpha", twice))
    for name in ("y[0]", "dx", "dW[0]"):
        assert found[(name, "fp32")].ratio >= least, found[(name, "fp32")]
        assert found[(name, "reference")].ratio > 1e3, found[(name, "reference")]


def test_a_missing_bias_gradient_fails(monkeypatch) -> None:
    """db left at zero: fails both comparisons (db's bound is its fp32 sum's rounding)."""
    case = Case("nvfp4", "auto", **BASE)

    def no_bias_grad(dy, dtype):
        return None if dtype is None else torch.zeros(dy.shape[-1], dtype=dtype)

    found = faulty(case, lambda: monkeypatch.setattr(ops, "bias_grad", no_bias_grad))
    assert found[("db[0]", "fp32")].ratio >= 1e3 and found[("db[0]", "reference")].ratio > 1


def test_missing_gradient_terms_fail(monkeypatch) -> None:
    """The last 16 of 37 tokens' terms missing from dx and dW (dy's rows lost on the way to
    the backward GEMMs): dx and dW fail the fp32 bound (measured: NVFP4 2.6x and 2.7x, FP8
    blockwise 13x) and the reference path; y passes."""
    case = Case("nvfp4", "auto", **BASE)
    real = linear.Linear.backward_gemms

    def lossy(self, dy2, x2, weight, **kw):
        dy2 = dy2.clone()
        dy2[-16:] = 0
        return real(self, dy2, x2, weight, **kw)

    found = faulty(case, lambda: monkeypatch.setattr(linear.Linear, "backward_gemms", lossy))
    for name in ("dx", "dW[0]"):
        assert found[(name, "fp32")].ratio >= 2.0, found[(name, "fp32")]
        assert found[(name, "reference")].ratio > 1
    assert found[("y[0]", "fp32")].ratio <= 1 and found[("y[0]", "reference")].ratio == 0


def test_a_group_missing_a_members_dx_fails(monkeypatch) -> None:
    """A layer group that sums only its last member's dx: dx fails the fp32 bound (measured
    3.3x) and the reference path (bit for bit there)."""
    case = Case("nvfp4_no_sr", "auto", **{**BASE, "mode": "layer_groups"})
    found = faulty(
        case,
        lambda: monkeypatch.setattr(
            layer_groups, "_sum_newest_first", lambda dxs, out=None: dxs[-1]
        ),
    )
    assert found[("dx", "fp32")].ratio >= 2.5, found[("dx", "fp32")]
    assert found[("dx", "reference")].ratio > 1
