"""The recipe fuzzer on a GPU: drawn recipes run their planned kernels and train bit for bit
like the reference path.

A seeded batch of recipes is drawn from ``tests/recipe_strategies.py`` (``recipe_cases()``):
200 by default, ``FP4GEN_FUZZ_EXAMPLES=N`` for N. The batch is drawn by hypothesis' own engine,
``@given`` with ``@seed(SEED)``, the database off and only the generate phase, collecting each
example (``draw_batch``): a seed then always gives the same recipes in the same order (for one
hypothesis version), which ``.example()`` does not promise, and the recipes exist before any
test runs, so every kernel of the batch is compiled up front in parallel and each recipe is a
test of its own (``test_...[17]``). The default seed is ``DEFAULT_SEED`` (the same batch every
run); with ``FP4GEN_FUZZ_EXAMPLES`` and no seed a fresh one is drawn. Each test prints
``FP4GEN_FUZZ_SEED=...``, which replays the batch.

For each recipe fp4gen accepts (the one refusal drawn on purpose is skipped), on CUDA:

1. every quantize kernel and MoR kernel its plan lists (``fp4gen.compiler.plan.plan_recipe``)
   runs on seeded bf16 tensors (and, as a test of its own, fp32 tensors: the kernels' fp32
   twins) of two shapes (one aligned to every block and RHT, one that is
   not) through the runtime: a single rowwise copy through ``fp4gen.quantize(backend="cute")``,
   a tile kernel (columnwise or two copies) through the runtime loader
   (``fp4gen.runtime.kernels.kernels_for`` via ``cute_backend``), a MoR kernel through
   ``mor_quantize(backend="cute")``. Codes, scales and the global scale must equal the
   reference quantizer's (``fp4gen.numerics``, the same seed and Philox offsets) bit for bit.
   Where the kernels refuse the spec or the shape, the reason must be one of the documented
   ones (``REFUSALS``: docs/testing.md, "Fallbacks and their reasons"), and ``backend="auto"``
   must log it once (two calls, one INFO line) and give the reference's result;
2. three SGD steps of a two-layer model (two ``fp4gen.nn.Linear`` with the recipe and a bias,
   bf16, odd sizes, the recipe's schedule over the three steps; and, as parameters of the test, an
   fp32 model and an fp32 model under bf16 autocast, ``PRECISIONS``) with the default backends,
   against the same model with ``backend="reference"`` and reference GEMMs. In the default run
   every ``fp4gen.gemm`` call is checked against the reference product of the same operands
   (bit for bit where the call ran on the reference, else within the fp32 summation-order
   bound of docs/numerics.md 6, as ``tests/test_conformance.py`` states it) and then hands the
   reference product on, so both runs see the same values: losses, outputs, gradients and the
   final weights must then be equal bit for bit, which checks every quantize call of training
   (device Philox offsets, tile kernels, padding) exactly. Every GEMM fallback (a pair no fused
   kernel or native MMA serves) must be logged once with its reason, and no fallback line twice.
3. one forward and backward of a converted Mixture-of-Experts layer (tests/test_moe.py's tiny
   Mixtral, Qwen3-MoE and gpt-oss in turn, unequal groups with an empty expert) on CUDA, the
   grouped path where the table allows it, against the per-expert reference on the CPU, as
   ``tests/moe_harness.py`` compares them: every expert GEMM's operands bit for bit, every
   product within its bound and then handed on, every result bit for bit
   (``experts_problems``; the CPU test runs the grouped path on the CPU).
4. the first step of 2's training on CUDA against the same step on the CPU reference: every
   quantized GEMM operand bit for bit (``devices_problems``; 2 hands on products computed on
   the CPU in every run, so the devices quantize the same values).

The CPU tests run the same harness with the reference on both sides for three recipes (so the
harness itself is tested without a GPU), check that it reports an injected difference, and
that every reason the planner gives over a batch of drawn recipes is one of the documented
kinds.

Run on a GPU (sm_90a or sm_100a)::

    pytest -m gpu tests/test_recipe_fuzz_gpu.py
    FP4GEN_FUZZ_EXAMPLES=1000 pytest -m gpu tests/test_recipe_fuzz_gpu.py   # a fresh seed
    FP4GEN_FUZZ_SEED=1234 pytest -m gpu tests/test_recipe_fuzz_gpu.py   # replay a batch
    FP4GEN_FUZZ_FAILURES=DIR pytest -m gpu ...   # each failing recipe's text kept in DIR at once
    FP4GEN_FUZZ_REPLAY=DIR pytest -m gpu tests/test_recipe_fuzz_gpu.py   # those recipes again

A seed replays a batch where hypothesis is the same version: each test prints the batch's
digest and hypothesis' version beside the seed, so two machines can tell whether they drew the
same recipes. A kept failure replays anywhere: ``FP4GEN_FUZZ_FAILURES`` also writes the
recipe's files (DIR/<kind>-<index>/) with the seed and index its inputs were drawn from, and
``FP4GEN_FUZZ_REPLAY=DIR`` runs the GPU tests on those recipes, with those inputs, instead of a
drawn batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from torch import nn

import fp4gen
import fp4gen.gemm_dispatch as gd
from fp4gen.compiler.build import compile_recipes, prepare_builds
from fp4gen.compiler.plan import (
    columnwise_tile_reason,
    plan_recipe,
    redrawn_tile_reason,
    tile_reason,
)
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Recipe, RHTSpec
from fp4gen.errors import FP4GenError
from fp4gen.formats import BlockFormat
from fp4gen.numerics.mor import MoRTensor
from fp4gen.numerics.mor import mor_quantize as reference_mor_quantize
from fp4gen.numerics.quantize import QuantizedTensor
from fp4gen.numerics.quantize import quantize as reference_quantize
from fp4gen.runtime import cute_backend, fp8_gemm, linear, mor_kernels
from fp4gen.runtime.loader import LogOnce, Unsupported
from fp4gen.runtime.quantize_dispatch import mor_quantize, quantize
from fp4gen.settings import LAYER_GRAPHS_VAR, LAYER_GROUPS_VAR
from fp4gen.spec import MoRKernelSpec, QuantKernelSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:  # a fixture; tests/ is on the path under pytest, the repository root for tests.ptx_identity
    from option_kernels import option_kernels_on  # noqa: F401
except ImportError:
    from tests.option_kernels import option_kernels_on  # noqa: F401
from recipe_strategies import REFUSALS as RECIPE_REFUSALS  # noqa: E402
from recipe_strategies import RecipeCase, recipe_cases  # noqa: E402
from test_conformance import TC_REL, U32, UNIT, environment  # noqa: E402

sys.path.remove(str(Path(__file__).resolve().parent))

ON_GPU = torch.cuda.is_available()
DEFAULT_SEED = 20251
DEFAULT_EXAMPLES = 200
EXAMPLES = int(os.environ.get("FP4GEN_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
if "FP4GEN_FUZZ_SEED" in os.environ:
    SEED = int(os.environ["FP4GEN_FUZZ_SEED"])
elif "FP4GEN_FUZZ_EXAMPLES" in os.environ:
    # hunting: a fresh batch, printed for the replay; the workers of one pytest-xdist run draw
    # the same one (each drew its own before, so a test index named different recipes)
    _RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    SEED = (
        int(hashlib.sha256(_RUN.encode()).hexdigest()[:8], 16) if _RUN else random.randrange(2**32)
    )
else:
    SEED = DEFAULT_SEED


def replay_cases(folder: Path) -> list[tuple[RecipeCase, int, int]]:
    """The recipes ``FP4GEN_FUZZ_FAILURES`` kept in ``folder`` (each DIR/<kind>-<index>/: the
    recipe's files and replay.json), as (case, seed, index): the seed and index its inputs
    were drawn from."""
    cases = []
    for kept in sorted(p for p in folder.iterdir() if (p / "replay.json").is_file()):
        meta = json.loads((kept / "replay.json").read_text())
        files = {
            str(f.relative_to(kept)): f.read_bytes().decode("utf-8")
            for f in sorted(kept.rglob("*"))
            if f.is_file() and f.name != "replay.json"
        }
        cases.append((RecipeCase(files=files, main=meta["main"]), meta["seed"], meta["index"]))
    return cases


REPLAY = os.environ.get("FP4GEN_FUZZ_REPLAY")
REPLAYED = replay_cases(Path(REPLAY)) if REPLAY else None
if REPLAYED is not None:
    EXAMPLES = len(REPLAYED)
CPU_RECIPES = 3  # the CPU run of the harness
STEPS = 3
TOKENS, IN_FEATURES, HIDDEN, OUT_FEATURES = 37, 100, 52, 24  # multiples of no block or RHT
ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# The documented reasons (docs/testing.md, "Fallbacks and their reasons")
# ---------------------------------------------------------------------------------------------

# Why the quantize and MoR kernels refuse a planned spec or an input shape: (kind, pattern of
# the runtime's reason). A reason outside these fails the test: document it first.
REFUSALS: tuple[tuple[str, str], ...] = (
    ("block length", r"block length \d+ is not a multiple of 8"),
    ("tile block shape", r"the tile kernels take 1xB and BxB blocks with B a power of two >= 8"),
    ("block beyond a CTA", r"blocks span more than one CTA"),
    ("row block beyond a warp", r"a row block would span \d+ lanes"),
    ("RHT size", r"RHT size \d+ is not supported"),
    ("row RHT too wide", r"with an RHT of size \d+: a thread would hold \d+ elements"),
    ("column RHT too tall", r"a column RHT of size \d+: a thread's strip holds at most"),
    ("column RHT across warps", r"a column RHT with column blocks spanning several warps"),
    ("row RHT with a column copy", r"a rowwise RHT in a kernel with a columnwise output"),
    ("RHT with 2D blocks", r"an RHT with 2D blocks"),
    ("2D copies round alike", r"with 2D blocks both copies are one set of codes"),
    ("input shape", r"[KM] must be a multiple of \d+"),
    ("MoR rounding", r"rounding '\w+': the MoR kernels round nearest or zero"),
    ("MoR block shape", r"(decision|scale) block \d+x\d+: (at least 8 columns|the kernels take)"),
    ("MoR candidates", r"a rule without element candidates|MoR candidates must be signed"),
    ("options of the rowwise kernel", r"implemented by the rowwise kernel only"),
    ("MS-EDEN group", r"MS-EDEN (over \d+ values with|group of \d+ values spans|with the ocp)"),
    ("codes not whole bytes", r"codes of \d+ bits along [KM] are not whole bytes"),
)
# What the planner leaves to the reference or to high precision, and the GEMM fallbacks
PLAN_REASONS: tuple[tuple[str, str], ...] = (
    ("high precision operand", r"^high precision \(\w+\): no quantization$"),
    ("eval in high precision", r"^eval runs the forward in \w+: no quantization$"),
    ("layer rule in high precision", r"^layer rule keeps these layers in \w+$"),
    ("layer rule runs a recipe", r"^layer rule runs recipe .+ \(planned with it\)$"),
    ("MoR with an RHT", r"^Mixture of Representations rule .+ with an RHT: the MoR kernels do"),
    ("GEMM in high precision or MoR", r"^no GEMM kernel: an operand is high precision or a MoR"),
    ("no fused sm_90a kernel", r"^no fused kernel \(.+\): "),
    ("no native sm_100a MMA", r"^no native MMA \(.+\): "),
    ("torch decode", r"torch decode \+ GEMM \(.+\)$"),
    (
        "block targets or stochastic block scales with 2D blocks",
        r"on \d+x\d+ blocks: only the rowwise kernel \(1D blocks\) implements them",
    ),
    ("per-row global scales in a GEMM", r"^per-row global scales: the GEMM kernels take one"),
    ("signs drawn per layer or step, MoR", r"^rht \d+ signs (layer|step): the signs are drawn"),
    ("RHT and blocks that do not nest", r"^rht \d+ with 1x\d+ blocks: the kernels need the block"),
    ("fp32 accumulator overflow", r"the float64 reference \(an fp32 accumulator could overflow"),
)


def refusal_kind(reason: str) -> str | None:
    """The documented kind of a kernel refusal, or None."""
    return next((kind for kind, pattern in REFUSALS if re.search(pattern, reason)), None)


# ---------------------------------------------------------------------------------------------
# The batch
# ---------------------------------------------------------------------------------------------


def draw_batch(batch_seed: int, count: int) -> list[RecipeCase]:
    """``count`` recipes drawn by hypothesis from ``batch_seed`` (module docstring): the same
    list for the same seed."""
    cases: list[RecipeCase] = []

    @settings(
        max_examples=count,
        database=None,
        derandomize=False,
        phases=(Phase.generate,),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @seed(batch_seed)
    @given(case=recipe_cases())
    def collect(case: RecipeCase) -> None:
        cases.append(case)

    collect()
    return cases[:count]


@functools.cache
def batch(batch_seed: int, count: int) -> tuple[RecipeCase, ...]:
    return tuple(draw_batch(batch_seed, count))


def load_case(case: RecipeCase, folder: Path) -> Recipe | None:
    """The recipe with its files written under ``folder``; None where fp4gen refuses it on
    purpose (``RecipeCase.refusable``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = case.write(folder)
    try:
        return load_recipe(path)
    except FP4GenError as err:
        if case.refusable and any(reason in str(err) for reason in RECIPE_REFUSALS):
            return None
        raise


# ---------------------------------------------------------------------------------------------
# 1. The planned quantize and MoR kernels
# ---------------------------------------------------------------------------------------------

Quantized = QuantizedTensor | MoRTensor


@dataclass
class KernelResult:
    """One planned kernel on one input: ``refused`` is None where it ran and matched."""

    kernel: str
    shape: tuple[int, int]
    refused: str | None = None
    differences: list[str] = field(default_factory=list)


def block_format(spec: QuantKernelSpec) -> BlockFormat:
    return BlockFormat(
        "planned",
        spec.element,
        spec.block,
        spec.scale,
        spec.global_scale,
        targets=spec.targets,
        target_error=spec.target_error,
        global_bound=spec.global_bound,
        global_rows=spec.global_rows,
        eden_group=spec.eden_group,
    )


def call_rht(rht: RHTSpec | None) -> RHTSpec | None:
    """A copy's transform as a call takes it: signs drawn per layer or step at layer 3, step
    5 (the kernel spec holds the canonical transform, the call its own)."""
    return rht.at(3, 5) if rht is not None and rht.redrawn else rht


def kernel_shapes(spec: QuantKernelSpec | MoRKernelSpec) -> list[tuple[int, int]]:
    """An input aligned to every block and RHT of the spec, and one a few rows and columns off."""
    if isinstance(spec, MoRKernelSpec):
        return [(128, 256), (37, 100)]
    rhts = {o.direction: o.rht.size for o in spec.outputs if o.rht is not None}
    cols = math.lcm(64, spec.block[1], *rhts.values())
    rows = math.lcm(64, spec.block[0], *rhts.values())
    # an RHT runs along whole groups of its size (the reference refuses other lengths)
    return [(rows, cols), (rows + rhts.get("columnwise", 5), cols + max(8, rhts.get("rowwise", 8)))]


INPUT_DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # the specs' names of them


def make_input(
    shape: tuple[int, int],
    device: str,
    rnd: random.Random,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Gaussian values times 2^e (e in [-40, 40]), a zero row now and then, in ``dtype`` (bf16,
    or fp32 with every mantissa bit drawn); drawn on the CPU, so both devices see the same
    numbers."""
    g = torch.Generator().manual_seed(rnd.getrandbits(63))
    x = torch.randn(shape, generator=g) * 2.0 ** rnd.randint(-40, 40)
    if rnd.random() < 0.3:
        x[rnd.randrange(shape[0])] = 0
    return x.to(dtype).to(device)


def reference_copies(
    spec: QuantKernelSpec, x: torch.Tensor, seed_: int, offsets: tuple[int, ...]
) -> list[QuantizedTensor]:
    """Each output of ``spec`` as the reference makes it: a rowwise copy quantizes x, a 1D
    columnwise one x.t(); with 2D blocks both are one set of codes (the columnwise copy its
    transpose)."""
    fmt = block_format(spec)
    if spec.block[0] != 1:
        o = spec.outputs[0]
        q = reference_quantize(x, fmt, rounding=o.rounding, seed=seed_, offset=offsets[0])
        return [q if o.direction == "rowwise" else q.transpose() for o in spec.outputs]
    copies = []
    for o, offset in zip(spec.outputs, offsets, strict=True):
        src = x if o.direction == "rowwise" else x.t().contiguous()
        copies.append(
            reference_quantize(
                src, fmt, rounding=o.rounding, hadamard=call_rht(o.rht), seed=seed_, offset=offset
            )
        )
    return copies


def single_rowwise(spec: QuantKernelSpec) -> bool:
    """The spec ``fp4gen.quantize`` itself loads: one rowwise copy, 1D blocks."""
    return spec.block[0] == 1 and [o.direction for o in spec.outputs] == ["rowwise"]


class Refused(Exception):
    """The kernels do not serve a spec or input; ``args[0]`` is the runtime's reason."""


def kernel_copies(
    spec: QuantKernelSpec, x: torch.Tensor, seed_: int, offsets: tuple[int, ...], backend: str
) -> list[QuantizedTensor]:
    """Each output of ``spec`` from ``backend``: "cute" runs the kernels through the runtime
    (raises Refused with its reason where they do not serve), "reference" is the harness run
    on the CPU (``fp4gen.quantize(backend="reference")`` per copy)."""
    fmt = block_format(spec)
    if backend == "reference" or single_rowwise(spec):
        if spec.block[0] != 1:
            o = spec.outputs[0]
            q = quantize(
                x, fmt, rounding=o.rounding, seed=seed_, offset=offsets[0], backend=backend
            )
            return [q if o.direction == "rowwise" else q.transpose() for o in spec.outputs]
        copies = []
        for o, offset in zip(spec.outputs, offsets, strict=True):
            src = x if o.direction == "rowwise" else x.t().contiguous()
            try:
                copies.append(
                    quantize(
                        src,
                        fmt,
                        rounding=o.rounding,
                        hadamard=call_rht(o.rht),
                        seed=seed_,
                        offset=offset,
                        backend=backend,
                    )
                )
            except FP4GenError as err:  # the cute backend's refusal (or the input's)
                raise Refused(str(err).split("is not available: ", 1)[-1]) from err
        return copies
    # a tile kernel: the runtime loader, the kernel's own input check, one launch
    loaded = cute_backend._kernels(spec)
    if isinstance(loaded, Unsupported):
        raise Refused(loaded.reason)
    try:
        loaded.module.check_input(x)
    except FP4GenError as err:
        # a shape the kernel does not take: the runtime zero-pads it where that is exact
        # (cute_backend._zero_padded), one launch whose copies are cut back
        outputs = tuple(
            (o.direction, o.rounding, o.rht, offset)
            for o, offset in zip(spec.outputs, offsets, strict=True)
        )
        padded = cute_backend.quantize_tile_cute(x, fmt, outputs, seed=seed_)
        if padded is None:
            raise Refused(str(err)) from err
        return list(padded)
    out = loaded.run(x, seed=seed_, offset=offsets)
    rows, cols = x.shape
    copies = []
    for o, offset in zip(spec.outputs, offsets, strict=True):
        prefix, n, shape = (
            ("", cols, (rows, cols)) if o.direction == "rowwise" else ("col_", rows, (cols, rows))
        )
        copies.append(
            cute_backend._quantized(
                out, prefix, fmt, n, o.rounding, o.rht, seed_, offset, torch.Size(shape), x.dtype
            )
        )
    return copies


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float tensor (NaNs and signed zeros compare as bits)."""
    t = t.detach().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def differences(got: Quantized, want: Quantized, tag: str) -> list[str]:
    """What differs between two quantized copies, bit for bit: codes, scales, global scale (a
    MoR tensor: choices, codes, high-precision values, the dequantized values)."""
    if isinstance(want, MoRTensor):
        assert isinstance(got, MoRTensor)
        pairs = {
            "choice": (got.choice, want.choice),
            "codes": (got.codes, want.codes),
            # the kernels write the rule's high-precision dtype (fp32 for a mix), the reference
            # fp32: compared as fp32 bits (every such value is exact in fp32)
            "high": (bits(got.high.float()), bits(want.high.float())),
            "values": (bits(got.dequantize().float()), bits(want.dequantize().float())),
        }
    else:
        assert isinstance(got, QuantizedTensor)
        pairs = {
            "codes": (got.codes, want.codes),
            "scales": (bits(got.scales.float()), bits(want.scales.float())),
            "global scale": (bits(got.global_scale.float()), bits(want.global_scale.float())),
        }
    found = []
    for name, (a, b) in pairs.items():
        a, b = a.cpu(), b.cpu()
        if a.shape != b.shape:
            found.append(f"{tag} {name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        elif not torch.equal(a, b):
            where = (a != b).nonzero()[0].tolist()
            found.append(f"{tag} {name}: {int((a != b).sum())} differ, first at {where}")
    return found


@contextlib.contextmanager
def fresh_quantize_logs() -> Iterator[None]:
    """The quantize and MoR backends' LogOnce forgets what it logged (for this block), so a
    fallback met earlier in the session is logged again."""
    saved = cute_backend._log_once, cute_backend._log_tile_once, mor_kernels._log_once
    cute_backend._log_once = LogOnce(saved[0].log, saved[0].message)
    cute_backend._log_tile_once = LogOnce(saved[1].log, saved[1].message)
    mor_kernels._log_once = LogOnce(saved[2].log, saved[2].message)
    try:
        yield
    finally:
        cute_backend._log_once, cute_backend._log_tile_once, mor_kernels._log_once = saved


def fallback_lines(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.name.startswith("fp4gen")]


def check_fallback_logged_once(
    spec: QuantKernelSpec | MoRKernelSpec,
    x: torch.Tensor,
    seed_: int,
    offsets: tuple[int, ...],
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> list[str]:
    """Two ``backend="auto"`` calls where the kernels refused with ``reason``: the result is
    the reference's, bit for bit, and ``reason`` is logged once. The problems found."""
    problems = []
    caplog.clear()
    with fresh_quantize_logs(), caplog.at_level(logging.INFO, logger="fp4gen"):
        for _ in range(2):
            if isinstance(spec, MoRKernelSpec):
                got: list[Quantized] = [
                    mor_quantize(
                        x, spec.rule, rounding=spec.rounding, seed=seed_, offset=offsets[0]
                    )
                ]
                want: list[Quantized] = [
                    reference_mor_quantize(
                        x, spec.rule, rounding=spec.rounding, seed=seed_, offset=offsets[0]
                    )
                ]
            elif single_rowwise(spec):
                o = spec.outputs[0]
                got = [
                    quantize(
                        x,
                        block_format(spec),
                        rounding=o.rounding,
                        hadamard=call_rht(o.rht),
                        seed=seed_,
                        offset=offsets[0],
                    )
                ]
                want = list(reference_copies(spec, x, seed_, offsets))
            else:  # what Linear asks first for a tensor's copies; None: one by one
                outputs = tuple(
                    (o.direction, o.rounding, o.rht, offset)
                    for o, offset in zip(spec.outputs, offsets, strict=True)
                )
                if cute_backend.quantize_tile_cute(x, block_format(spec), outputs, seed=seed_):
                    problems.append("quantize_tile_cute served a spec the kernels refused")
                got = want = []
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                problems += differences(a, b, f"auto copy {i}")
    lines = fallback_lines(caplog.records)
    # a 2D tile whose copies round stochastically or transform: the runtime quantizes the
    # copies one by one without asking the tile kernel, so nothing falls back or is logged
    silent = (
        isinstance(spec, QuantKernelSpec)
        and spec.block[0] != 1
        and any(o.rounding != "nearest" or o.rht is not None for o in spec.outputs)
    )
    # a tile spec refused for what only the rowwise kernel implements: the runtime says why
    # one launch cannot make the copies (they run one by one) instead of the spec's refusal
    reasons = [reason]
    if isinstance(spec, QuantKernelSpec) and not single_rowwise(spec):
        fmt = block_format(spec)
        routed = (tile_reason(fmt), *(redrawn_tile_reason(o.rht) for o in spec.outputs))
        if any(o.direction == "columnwise" for o in spec.outputs):
            # 2D tiles whose x.t() copy is not the transposed one: the runtime says so first
            routed += (columnwise_tile_reason(fmt),)
        reasons += [why for why in routed if why is not None]
    logged = [line for line in lines if any(why in line for why in reasons)]
    if not silent and len(logged) != 1:
        problems.append(f"the fallback {reason!r} was not logged once: {lines}")
    if len(lines) != len(set(lines)):
        problems.append(f"a fallback was logged twice: {lines}")
    return problems


def run_planned_kernels(
    recipe: Recipe,
    device: str,
    backend: str,
    rnd: random.Random,
    caplog: pytest.LogCaptureFixture | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> list[KernelResult]:
    """Every quantize and MoR kernel of the recipe's plan on each of its shapes (module
    docstring, 1): what ran and matched, what was refused and why, what differed. ``dtype``:
    the inputs' (the plan's kernels are bf16's; fp32 inputs run their fp32 twins, which the
    runtime compiles on first use)."""
    results = []
    for planned in plan_recipe(recipe).kernels:
        spec = planned.spec
        if dtype != torch.bfloat16:  # the twin the runtime loads for such inputs
            spec = dataclasses.replace(spec, input_dtype=INPUT_DTYPES[dtype])
        for shape in kernel_shapes(spec):
            x = make_input(shape, device, rnd, dtype)
            seed_ = rnd.getrandbits(64)
            count = 1 if isinstance(spec, MoRKernelSpec) else len(spec.outputs)
            offsets = tuple(rnd.getrandbits(40) for _ in range(count))
            result = KernelResult(spec.name, shape)
            try:
                if isinstance(spec, MoRKernelSpec):
                    got: list[Quantized] = [mor_copy(spec, x, seed_, offsets[0], backend)]
                    want: list[Quantized] = [
                        reference_mor_quantize(
                            x, spec.rule, rounding=spec.rounding, seed=seed_, offset=offsets[0]
                        )
                    ]
                else:
                    got = list(kernel_copies(spec, x, seed_, offsets, backend))
                    want = list(reference_copies(spec, x, seed_, offsets))
            except Refused as refusal:
                result.refused = str(refusal)
                if refusal_kind(result.refused) is None:
                    result.differences.append(f"undocumented refusal: {result.refused}")
                elif caplog is not None:
                    result.differences += check_fallback_logged_once(
                        spec, x, seed_, offsets, result.refused, caplog
                    )
                results.append(result)
                continue
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                result.differences += differences(a, b, f"copy {i}")
            results.append(result)
    return results


def mor_copy(spec: MoRKernelSpec, x: torch.Tensor, seed_: int, offset: int, backend: str) -> Any:
    try:
        return mor_quantize(
            x, spec.rule, rounding=spec.rounding, seed=seed_, offset=offset, backend=backend
        )
    except FP4GenError as err:
        raise Refused(str(err).split("is not available: ", 1)[-1]) from err


# ---------------------------------------------------------------------------------------------
# 2. Three training steps against the reference path
# ---------------------------------------------------------------------------------------------


@dataclass
class GemmCheck:
    """One ``fp4gen.gemm`` call of the default run: the backend auto chose, the worst ratio of
    |got - reference| to the bound (0 bit for bit; inf an exact call that differed)."""

    backend: str
    ratio: float
    fallback: str | None  # auto's reason for leaving the fused kernel / native MMA


@dataclass
class TrainRun:
    losses: list[torch.Tensor]
    outputs: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]
    gemms: list[GemmCheck] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    # every quantized GEMM's operands (codes, scales, global scale of A and of B, on the CPU):
    # where the runs differ, the first call whose operands differ says which quantize did
    operands: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # len(operands) as each step began

    def record_step(self, model: nn.Module, y: torch.Tensor, loss: torch.Tensor) -> None:
        """A step's output, loss and every parameter's gradient (before the optimizer's)."""
        self.outputs.append(y.detach().clone())
        self.losses.append(loss.detach().clone())
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters()})


def operand_pieces(a: QuantizedTensor, b: QuantizedTensor) -> tuple[torch.Tensor, ...]:
    return tuple(
        bits(t.float()).cpu() if t.is_floating_point() else t.cpu()
        for q in (a, b)
        for t in (q.codes, q.scales, q.global_scale)
    )


def gemm_bound_ratio(
    got: torch.Tensor, want: torch.Tensor, a: QuantizedTensor, b: QuantizedTensor, backend: str
) -> float:
    """max |got - want| / bound, the bound as test_conformance states docs/numerics.md 6:
    (2 (K + 8) u + adder) sum_k |a_k b_k| + unit (|got| + |want|) / (1 - unit), u = 2^-24, unit
    the output dtype's, adder Hopper's FP8 term (6.1) where the FP8 tensor cores ran on CUDA."""
    if backend == "reference":
        return 0.0 if torch.equal(got, want) else math.inf
    mag = a.dequantize(rotated=True).double().reshape(a.rows, a.cols).abs()
    mag = mag @ b.dequantize(rotated=True).double().reshape(b.rows, b.cols).abs().t()
    adder = fp8_adder(a, b, backend) if got.is_cuda else 0.0
    unit = UNIT[got.dtype]
    f, r = got.double(), want.double()
    limit = (2 * (a.cols + 8) * U32 + adder) * mag.reshape(f.shape)
    limit = limit + unit * (f.abs() + r.abs()) / (1 - unit)
    ratio = (f - r).abs() / limit.clamp_min(1e-300)
    # an overflowed product (inf, or NaN from inf - inf) must be the reference's own: equal
    # non-finite entries are exact (0), any other non-finite entry is outside every bound
    same = (f == r) | (f.isnan() & r.isnan())
    ratio = torch.where(same, 0.0, ratio.nan_to_num(nan=math.inf))
    return float(ratio.max()) if ratio.numel() else 0.0


def fp8_adder(a: QuantizedTensor, b: QuantizedTensor, backend: str) -> float:
    """Hopper's FP8 adder term (numerics.md 6.1) of a GEMM ``backend`` ran on the FP8 tensor
    cores (scaled_mm, or the generated FP8 kernel), else 0: 33 aligned terms of 13 fraction
    bits per wgmma k=32 step, over the K-block's steps (TC_REL for 128-wide K-blocks)."""
    if backend == "block_scaled":
        return TC_REL
    if backend == "cute" and fp8_gemm.cute_support(a.format, b.format) is None:
        return a.format.block[1] / 32 * 33 * 2.0**-13
    return 0.0


def on_cpu(q: QuantizedTensor) -> QuantizedTensor:
    """``q`` with its tensors copied to the CPU."""
    tensors, layout = q.split()
    return QuantizedTensor.join(tuple(None if t is None else t.cpu() for t in tensors), layout)


@contextlib.contextmanager
def gemms_of(default: bool, run: TrainRun) -> Iterator[None]:
    """The layers' GEMMs: the reference run's on the reference; the default run's on auto,
    each checked against the reference product of its operands, which it then returns (checks
    in ``run.gemms``); both runs record every quantized pair's operands (``run.operands``)."""
    real = linear.gemm
    checks = run.gemms

    def reference(a: Any, b: Any, **kw: Any) -> torch.Tensor:
        if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor) and not default:
            run.operands.append(operand_pieces(a, b))
        if not (isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor)):
            return real(a, b, **{**kw, "backend": "reference"})
        # the float64 product on the CPU, whatever the device: a CPU run and a CUDA run then
        # hand on the same values (``check_devices``)
        device = a.device
        kw = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        return real(on_cpu(a), on_cpu(b), **{**kw, "backend": "reference"}).to(device)

    def checked(a: Any, b: Any, **kw: Any) -> torch.Tensor:
        if not (isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor)):
            return real(a, b, **kw)
        run.operands.append(operand_pieces(a, b))
        choice = gd.auto_backend(a, b)
        out = kw.pop("out", None)
        got = real(a, b, **{**kw, "backend": "auto"}).clone()
        want = reference(a, b, **kw)
        ratio = gemm_bound_ratio(got, want, a, b, choice.backend)
        checks.append(GemmCheck(choice.backend, ratio, choice.why if choice.fallback else None))
        if out is not None:
            out.copy_(want)
            return out
        return want

    linear.gemm = checked if default else reference  # type: ignore[assignment]
    try:
        yield
    finally:
        linear.gemm = real  # type: ignore[assignment]


# How the training harness's model holds and computes its values: the parameters' and input's
# dtype, and whether the steps run under bf16 autocast (fp32 parameters, bf16 GEMM inputs).
PRECISIONS: dict[str, tuple[torch.dtype, bool]] = {
    "bf16": (torch.bfloat16, False),
    "fp32": (torch.float32, False),
    "autocast": (torch.float32, True),
}


def train(recipe: Recipe, device: str, *, default: bool, precision: str = "bf16") -> TrainRun:
    """Three SGD steps of Linear -> Linear (module docstring, 2); ``default``: the default
    backends (else quantize and GEMMs on the reference); ``precision``: a ``PRECISIONS`` key."""
    g = torch.Generator().manual_seed(SEED % 2**63)
    dtype, autocast = PRECISIONS[precision]
    backend = "auto" if default else "reference"
    layers = [
        fp4gen.nn.Linear(n_in, n_out, recipe=recipe, seed=7 + i, name=f"layer{i}", backend=backend)
        for i, (n_in, n_out) in enumerate([(IN_FEATURES, HIDDEN), (HIDDEN, OUT_FEATURES)])
    ]
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    model = model.to(device=device, dtype=dtype)
    x = torch.randn(TOKENS, IN_FEATURES, generator=g).to(device=device, dtype=dtype)
    target = torch.randn(TOKENS, OUT_FEATURES, generator=g).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = TrainRun([], [], [], {})
    env = {LAYER_GROUPS_VAR: "0", LAYER_GRAPHS_VAR: "0"}  # every GEMM through linear.gemm
    with environment(**env), gemms_of(default, run):
        for step in range(STEPS):
            run.steps.append(len(run.operands))
            fp4gen.set_step(model, step, total_steps=STEPS)  # the schedule's switches
            opt.zero_grad()
            with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=autocast):
                y = model(x)
            loss = (y.float() - target).pow(2).mean()
            loss.backward()
            run.record_step(model, y, loss)
            opt.step()
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


def train_and_compare(
    recipe: Recipe,
    device: str,
    *,
    default: bool,
    caplog: pytest.LogCaptureFixture | None,
    precision: str = "bf16",
) -> tuple[TrainRun, list[str]]:
    """The run (default backends or the reference) against the reference run, both in
    ``precision`` (a ``PRECISIONS`` key): the problems."""
    want = train(recipe, device, default=False, precision=precision)
    saved = gd._logged
    gd._logged = set()  # GEMM fallbacks met earlier in the session are logged again
    try:
        if caplog is not None:
            caplog.clear()
        with (
            fresh_quantize_logs(),
            caplog.at_level(logging.INFO, logger="fp4gen") if caplog else contextlib.nullcontext(),
        ):
            got = train(recipe, device, default=default, precision=precision)
        got.log = fallback_lines(caplog.records) if caplog is not None else []
    finally:
        gd._logged = saved
    problems = []
    if len(got.operands) != len(want.operands):
        made = f"{len(got.operands)} quantized GEMM calls"
        problems.append(f"{made}, the reference path made {len(want.operands)}")
    names = [f"A {n}" for n in ("codes", "scales", "global scale")]
    names += [f"B {n}" for n in ("codes", "scales", "global scale")]
    for i, (g, w) in enumerate(zip(got.operands, want.operands, strict=False)):
        bad = [n for n, x, y in zip(names, g, w, strict=True) if not torch.equal(x, y)]
        if bad:  # the first call only: later ones follow from it
            problems.append(f"quantized GEMM call {i}: operand {', '.join(bad)} differ")
            break
    for step in range(STEPS):
        for name, a, b in [
            ("loss", got.losses[step], want.losses[step]),
            ("y", got.outputs[step], want.outputs[step]),
            *[(f"grad {n}", got.grads[step][n], want.grads[step][n]) for n in want.grads[step]],
        ]:
            if not torch.equal(bits(a), bits(b)):
                problems.append(f"step {step}: {name} differs from the reference path")
    for name, p in want.params.items():
        if not torch.equal(bits(got.params[name]), bits(p)):
            problems.append(f"the trained {name} differs from the reference path")
    for i, check in enumerate(got.gemms):
        if not check.ratio <= 1.0:
            problems.append(f"GEMM call {i} on {check.backend}: x{check.ratio:.3g} the bound")
    if caplog is not None:
        if len(got.log) != len(set(got.log)):
            problems.append(f"a fallback was logged twice: {got.log}")
        for why in {c.fallback for c in got.gemms if c.fallback}:
            if not any(why in line for line in got.log):
                problems.append(f"the GEMM fallback {why!r} was not logged")
    return got, problems


# ---------------------------------------------------------------------------------------------
# The GPU tests
# ---------------------------------------------------------------------------------------------

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def gpu_batch(tmp_path_factory: pytest.TempPathFactory) -> list[Recipe | None]:
    """The batch's recipes (None: refused on purpose); in one process, every kernel they load
    compiled up front for this GPU's arch, in parallel, into the kernel cache the runtime reads."""
    from fp4gen.compiler.jit import detect_arch

    arch = detect_arch()
    if arch not in ("sm_90a", "sm_100a"):
        pytest.skip(f"no generated kernels for {arch}")
    root = tmp_path_factory.mktemp("fuzz-gpu")
    recipes = [load_case(drawn(i)[0], root / f"case{i}") for i in range(EXAMPLES)]
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        # one process: every kernel compiled up front in parallel, across recipes, each with a
        # plain name for its source folder (a drawn name need not be one; kernels are cached
        # by their specs). Under pytest-xdist each test's kernels compile on first use instead,
        # spread over the workers (compiling the batch in every worker, or in one while the
        # others wait, is slower than that).
        jobs = max(2, (os.cpu_count() or 2) - 1)
        named = [dataclasses.replace(r, name=f"r{i}") for i, r in enumerate(recipes) if r]
        report = compile_recipes(named, archs=(arch,), out=root / "gen", jobs=jobs)
        assert not report.errors, report.errors[:3]
    return recipes


@pytest.fixture(autouse=True)
def all_option_kernels_on(option_kernels_on: None) -> None:  # noqa: F811
    """The fuzzer checks every kernel, the block-scale options' too (on by default; made sure
    of here: fp4gen.runtime.cute_backend.set_option_kernels)."""


@functools.cache
def batch_digest(batch_seed: int, count: int) -> str:
    """A digest of the batch's recipe texts: equal on two machines iff they drew the same batch
    (hypothesis' engine draws it, so its version is part of what a seed replays)."""
    text = "\n".join(case.listing() for case in batch(batch_seed, count))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def drawn(index: int) -> tuple[RecipeCase, int, int]:
    """Test ``index``'s recipe, with the seed and index its inputs are drawn from: the batch's,
    or a kept failure's (``FP4GEN_FUZZ_REPLAY``)."""
    if REPLAYED is not None:
        return REPLAYED[index]
    return batch(SEED, EXAMPLES)[index], SEED, index


def announce() -> None:
    if REPLAYED is not None:
        print(f"recipe fuzz (GPU): {EXAMPLES} kept recipes from FP4GEN_FUZZ_REPLAY={REPLAY}")
        return
    print(
        f"recipe fuzz (GPU): FP4GEN_FUZZ_SEED={SEED} FP4GEN_FUZZ_EXAMPLES={EXAMPLES} replays "
        f"(batch {batch_digest(SEED, EXAMPLES)}, hypothesis {hypothesis.__version__})"
    )


def keep_failure(kind: str, index: int, text: str, case: RecipeCase | None = None) -> None:
    """With ``FP4GEN_FUZZ_FAILURES=DIR``, a failing recipe's listing and differences go to
    DIR/<kind>-<index>.txt as the test fails, so a run cut short by a time limit keeps them;
    with ``case`` (test ``index``'s recipe) its files go to DIR/<kind>-<index>/ too, with the
    seed and index its inputs came from (replay.json), which ``FP4GEN_FUZZ_REPLAY`` reads."""
    folder = os.environ.get("FP4GEN_FUZZ_FAILURES")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{kind}-{index}.txt").write_text(text)
        if case is not None:
            _, seed, drawn_index = drawn(index)
            kept = Path(folder) / f"{kind}-{index}"
            kept.mkdir(exist_ok=True)
            case.write(kept)
            meta = {"seed": seed, "index": drawn_index, "main": case.main}
            (kept / "replay.json").write_text(json.dumps(meta))


def check_planned_kernels(
    index: int,
    gpu_batch: list[Recipe | None],
    caplog: pytest.LogCaptureFixture,
    dtype: torch.dtype,
) -> None:
    """Recipe ``index``'s planned kernels on CUDA inputs of ``dtype`` (bf16: the plan's own
    kernels; fp32: their twins): every difference fails the test, kept as
    ``kernels-N`` (``kernels-fp32-N``)."""
    announce()
    recipe = gpu_batch[index]
    if recipe is None:
        pytest.skip("a recipe fp4gen refuses on purpose")
    case, seed, drawn_index = drawn(index)
    tag = "kernels" if dtype == torch.bfloat16 else f"kernels-{INPUT_DTYPES[dtype]}"
    rnd = random.Random(f"{seed}/{drawn_index}/{tag}")
    results = run_planned_kernels(recipe, "cuda", "cute", rnd, caplog, dtype)
    torch.cuda.synchronize()
    bad = [f"{r.kernel} {r.shape}: {d}" for r in results for d in r.differences]
    if bad:
        message = f"{case.listing()}\n" + "\n".join(bad[:10])
        keep_failure(tag, index, message, case)
        pytest.fail(message)


@pytest.mark.parametrize("index", range(EXAMPLES))
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_planned_kernels_match_the_reference_on_gpu(
    index: int, gpu_batch: list[Recipe | None], caplog: pytest.LogCaptureFixture
) -> None:
    check_planned_kernels(index, gpu_batch, caplog, torch.bfloat16)


@pytest.mark.parametrize("index", range(EXAMPLES))
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_planned_kernels_on_fp32_inputs_match_the_reference_on_gpu(
    index: int, gpu_batch: list[Recipe | None], caplog: pytest.LogCaptureFixture
) -> None:
    """The planned kernels' fp32 twins (an fp32 model, or a ``from`` source's dequantized
    copy quantized again), on fp32 inputs with every mantissa bit drawn: bit for bit the
    reference, or refused with a documented reason."""
    check_planned_kernels(index, gpu_batch, caplog, torch.float32)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("index", range(EXAMPLES))
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_training_steps_match_the_reference_path_on_gpu(
    index: int, precision: str, gpu_batch: list[Recipe | None], caplog: pytest.LogCaptureFixture
) -> None:
    """The training steps of a bf16 model, an fp32 model and an fp32 model under bf16 autocast
    (fp32 parameters, the layers' inputs cast by autocast), bit for bit the reference path."""
    announce()
    recipe = gpu_batch[index]
    if recipe is None:
        pytest.skip("a recipe fp4gen refuses on purpose")
    check_training(index, recipe, caplog, precision)


def check_training(
    index: int, recipe: Recipe, caplog: pytest.LogCaptureFixture, precision: str
) -> None:
    """Recipe ``index``'s training steps in ``precision`` on CUDA against the reference path;
    a failure is kept (``FP4GEN_FUZZ_FAILURES``) and fails the test."""
    got, problems = train_and_compare(
        recipe, "cuda", default=True, caplog=caplog, precision=precision
    )
    if problems:
        case = drawn(index)[0]
        message = f"{case.listing()}\n" + "\n".join(problems[:10])
        kind = "training" if precision == "bf16" else f"training-{precision}"
        keep_failure(kind, index, message, case)
        pytest.fail(message)


@pytest.mark.parametrize("index", range(EXAMPLES))
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_the_first_step_quantizes_as_the_cpu_does(
    index: int, gpu_batch: list[Recipe | None]
) -> None:
    """The first training step of the default CUDA run against the same step on the CPU
    reference: every quantized GEMM operand bit for bit. Both runs hand on the same products
    (the float64 product on the CPU, ``gemms_of``), so every operand of the step, the
    backward's too, is quantized from the same values; later steps may part only because the
    bias gradient is a reduction in each device's order. The training test compares CUDA with
    the reference path on CUDA, which shares the runtime's device state (its Philox counters):
    this one compares the devices, as the experts test does."""
    announce()
    recipe = gpu_batch[index]
    if recipe is None:
        pytest.skip("a recipe fp4gen refuses on purpose")
    problems = devices_problems(recipe)
    if problems:
        case = drawn(index)[0]
        message = f"{case.listing()}\n" + "\n".join(problems[:10])
        keep_failure("devices", index, message, case)
        pytest.fail(message)


def devices_problems(recipe: Recipe, device: str = "cuda") -> list[str]:
    """``recipe``'s first training step on ``device`` (default backends) against the CPU
    reference's: the differences of the quantized GEMM operands."""
    want = train(recipe, "cpu", default=False)
    got = train(recipe, device, default=True)
    first_want = want.operands[: want.steps[1]]
    first_got = got.operands[: got.steps[1]]
    if len(first_got) != len(first_want):
        made = f"{len(first_got)} quantized GEMM calls in the first step"
        return [f"{made}, the CPU made {len(first_want)}"]
    names = [f"{side} {n}" for side in "AB" for n in ("codes", "scales", "global scale")]
    for i, (g, w) in enumerate(zip(first_got, first_want, strict=True)):
        bad = [n for n, x, y in zip(names, g, w, strict=True) if not torch.equal(x, y)]
        if bad:
            return [f"quantized GEMM call {i} of the first step: operand {', '.join(bad)} differ"]
    return []


@pytest.mark.parametrize("index", range(EXAMPLES))
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_experts_match_the_reference_path_on_gpu(
    index: int, gpu_batch: list[Recipe | None]
) -> None:
    """The drawn recipe on a Mixture-of-Experts layer (tests/test_moe.py's tiny Mixtral,
    Qwen3-MoE, gpt-oss and Llama 4, in turn: ``EXPERTS_ARCHS``): its converted experts'
    forward and backward on CUDA (the grouped path where the table allows, else the per-expert
    loop) against the CPU's
    reference, as tests/moe_harness.py compares them: every expert GEMM's operands bit for
    bit, every CUDA product within its bound, and with the products handed on every result
    bit for bit (the routing weights' gradient within one bf16 rounding)."""
    announce()
    recipe = gpu_batch[index]
    if recipe is None:
        pytest.skip("a recipe fp4gen refuses on purpose")
    problems = experts_problems(recipe, index, "cuda")
    if isinstance(problems, str):
        pytest.skip(problems)
    if problems:
        case = drawn(index)[0]
        message = f"{case.listing()}\n" + "\n".join(problems[:10])
        keep_failure("experts", index, message, case)
        pytest.fail(message)


@pytest.mark.parametrize("index", range(EXAMPLES))
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_static_experts_match_the_grouped_path_on_gpu(
    index: int, gpu_batch: list[Recipe | None]
) -> None:
    """The drawn recipe on the static experts (``GroupedExperts.static``, tests/
    test_static_experts.py's Mixtral experts at hidden 256, a routing with empty experts): where
    ``static_reason`` serves it, a first training step's output and gradients equal the grouped
    path's bit for bit; else the reason, which the test records as its skip."""
    from test_static_experts import experts_module, routed, step

    from fp4gen.compiler.jit import detect_arch
    from fp4gen.runtime.experts import GroupedExperts

    announce()
    recipe = gpu_batch[index]
    if recipe is None:
        pytest.skip("a recipe fp4gen refuses on purpose")
    if detect_arch() != "sm_90a":
        pytest.skip("the static products are built for sm_90a")
    try:
        modules = [experts_module(recipe, "cuda", seed=5, total_steps=STEPS) for _ in range(2)]
    except FP4GenError as err:
        pytest.skip(f"convert refuses the recipe on this model: {err}")
    if not isinstance(modules[0], GroupedExperts):
        pytest.skip("the recipe's layer rules keep the experts")
    hidden, routes, weights = routed(96, index)
    reason = modules[1].static_reason(hidden)
    if reason is not None:
        pytest.skip(f"static experts do not serve it: {reason}")
    modules[1].static = True
    dout = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(index)).to(hidden)
    want = step(modules[0], hidden, routes, weights, dout)
    got = step(modules[1], hidden, routes, weights, dout)
    names = ("output", "dx", "routing weights' gradient", "gate_up dW", "down dW")
    bad = [n for n, a, b in zip(names, got, want, strict=True) if not torch.equal(a, b)]
    if bad:
        case = drawn(index)[0]
        message = f"{case.listing()}\nstatic differs from grouped in: {', '.join(bad)}"
        keep_failure("static", index, message, case)
        pytest.fail(message)


# the MoE families the experts tests run in turn: routed (Mixtral, Qwen3-MoE, gpt-oss with
# biases and transposed weights) and sliced (Llama 4: every expert its own rows)
EXPERTS_ARCHS = ("mixtral", "qwen3_moe", "gpt_oss", "llama4")


def experts_problems(recipe: Recipe, index: int, device: str) -> list[str] | str:
    """Recipe ``index`` on a converted experts layer on ``device`` (CUDA: the default path; the
    CPU: the grouped path with the definitions standing in for the kernels) against the
    per-expert reference on the CPU: the problems, or why the case does not apply."""
    from moe_harness import harnessed_run, operand_differences, result_differences
    from test_moe import build, experts_of, routing

    from fp4gen.runtime.experts import GroupedExperts

    arch = EXPERTS_ARCHS[index % len(EXPERTS_ARCHS)]
    modules = []
    for where in ("cpu", device):
        model = build(arch, torch.bfloat16).to(where)
        try:
            fp4gen.convert(model, recipe, seed=5, total_steps=STEPS)
        except FP4GenError as err:  # refused on both devices alike, with the reason
            if modules:
                return [f"convert refused on {device} only: {err}"]
            return f"convert refuses the recipe on this model: {err}"
        modules.append(experts_of(model))
    if not isinstance(modules[1], GroupedExperts):
        return "the recipe's layer rules keep the first block's experts"
    table = modules[1].gemms[0][0].operands
    if modules[1]._keeps_everything(table, torch.bfloat16, torch.bfloat16):
        # nothing rounds: the replaced module's own torch GEMMs run (GroupedExperts._gemm), each
        # summed in its device's order; tests/test_moe.py checks that path against the module
        return "every operand is kept in the model's dtype: torch's own GEMMs on each device"
    if device == "cpu":
        modules[1].grouped = True
    routes, weights = routing(64, empty=2)
    rows = 64 * (4 if arch == "llama4" else 1)  # sliced: 4 experts' 64 rows each
    hidden = torch.randn(rows, 64, generator=torch.Generator().manual_seed(index)).bfloat16()
    args = (hidden, routes, weights.bfloat16())
    want = harnessed_run(modules[0], *args, check=False, glue_on_cpu=True)
    got = harnessed_run(
        modules[1], *(t.to(device) for t in args), check=True, glue_on_cpu=device != "cpu"
    )
    problems = got.harness.problems + operand_differences(got.harness, want.harness)
    problems += result_differences(got, want, routing_exact=device == "cpu")
    return [f"{arch}: {p}" for p in problems]


# ---------------------------------------------------------------------------------------------
# The CPU tests: the harness itself, and the documented reasons
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_recipes(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[RecipeCase, Recipe]]:
    """The first CPU_RECIPES accepted recipes of the default batch."""
    root = tmp_path_factory.mktemp("fuzz-cpu")
    found = []
    for i, case in enumerate(batch(DEFAULT_SEED, 12)):
        recipe = load_case(case, root / f"case{i}")
        if recipe is not None and plan_recipe(recipe).kernels:
            found.append((case, recipe))
        if len(found) == CPU_RECIPES:
            break
    assert len(found) == CPU_RECIPES
    return found


def test_the_batch_is_the_same_for_a_seed() -> None:
    first = [c.files for c in draw_batch(5, 4)]
    assert first == [c.files for c in draw_batch(5, 4)]
    assert len({str(f) for f in first}) == 4  # four different recipes
    assert first != [c.files for c in draw_batch(6, 4)]


def test_the_kernel_harness_on_the_cpu_reference(
    cpu_recipes: list[tuple[RecipeCase, Recipe]],
) -> None:
    """Both sides on the reference: every planned kernel of three recipes, on both shapes,
    bf16 and fp32 inputs (the fp32 twins' specs), matches bit for bit (a harness bug in the
    copies, shapes, offsets or twins would not)."""
    for index, (case, recipe) in enumerate(cpu_recipes):
        for dtype, name in INPUT_DTYPES.items():
            rnd = random.Random(f"{DEFAULT_SEED}/{index}/kernels")
            results = run_planned_kernels(recipe, "cpu", "reference", rnd, None, dtype)
            expected = sum(len(kernel_shapes(k.spec)) for k in plan_recipe(recipe).kernels)
            assert len(results) == expected > 0
            assert all(f"_{name}_" in r.kernel for r in results if r.kernel.startswith("quant"))
            bad = [f"{r.kernel} {r.shape}: {r.refused} {r.differences}" for r in results]
            bad = [b for r, b in zip(results, bad, strict=True) if r.refused or r.differences]
            assert not bad, case.listing() + "\n".join(bad)


def test_the_kernel_harness_reports_a_flipped_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel side whose first code is off by one is reported (codes differ, scales not)."""
    recipe = load_recipe(ROOT / "recipes" / "nvfp4.fp4r")
    real = kernel_copies

    def faulty(*args: Any, **kw: Any) -> list[QuantizedTensor]:
        copies = real(*args, **kw)
        codes = copies[0].codes.clone()
        codes[0, 0] ^= 1
        return [dataclasses.replace(copies[0], codes=codes), *copies[1:]]

    monkeypatch.setattr(sys.modules[__name__], "kernel_copies", faulty)
    results = run_planned_kernels(recipe, "cpu", "reference", random.Random(0))
    assert results and all(r.differences for r in results)
    assert all(
        d.startswith("copy 0 codes: 1 differ, first at [0, 0]")
        for r in results
        for d in r.differences
    )


def test_the_training_harness_on_the_cpu_reference(
    cpu_recipes: list[tuple[RecipeCase, Recipe]],
) -> None:
    """Both sides on the reference, on the CPU: three steps equal bit for bit, every GEMM
    checked with a zero ratio, and the loss moved by the steps."""
    for case, recipe in cpu_recipes:
        for precision in PRECISIONS:
            got, problems = train_and_compare(
                recipe, "cpu", default=False, caplog=None, precision=precision
            )
            assert not problems, f"{precision}: " + case.listing() + "\n".join(problems)
            start = train_params_at_start(PRECISIONS[precision][0])
            assert got.params["0.weight"].dtype == start.dtype
            assert not torch.equal(got.params["0.weight"], start)
            assert all(torch.isfinite(loss) for loss in got.losses)


def test_the_devices_harness_on_the_cpu(cpu_recipes: list[tuple[RecipeCase, Recipe]]) -> None:
    """The first-step comparison with the CPU on both sides: no difference."""
    for case, recipe in cpu_recipes:
        assert devices_problems(recipe, "cpu") == [], case.listing()


def test_the_experts_harness_on_the_cpu(tmp_path: Path) -> None:
    """The experts comparison with the grouped path on the CPU (the kernels' definitions
    standing in) against the per-expert reference: no problem, for the first recipes of the
    default batch it applies to, on each of the four models."""
    ran = 0
    for i, case in enumerate(batch(DEFAULT_SEED, 40)):
        recipe = load_case(case, tmp_path / f"case{i}")
        if recipe is None:
            continue
        for index in range(i, i + len(EXPERTS_ARCHS)):  # the MoE families in turn
            problems = experts_problems(recipe, index, "cpu")
            if isinstance(problems, str):
                break
            ran += 1
            assert not problems, case.listing() + "\n".join(problems)
        if ran >= 8:
            break
    assert ran >= 8


def train_params_at_start(dtype: torch.dtype) -> torch.Tensor:
    """The first layer's weight before training (the same draw ``train`` makes), in ``dtype``."""
    g = torch.Generator().manual_seed(SEED % 2**63)
    return (torch.randn(HIDDEN, IN_FEATURES, generator=g) / math.sqrt(IN_FEATURES)).to(dtype)


def test_the_gemm_check_catches_an_error_beyond_the_bound() -> None:
    """The per-call bound passes the fp32 result of the same product and fails one that is off
    by 1e-3 of its magnitude; an exact call must be bit for bit."""
    g = torch.Generator().manual_seed(3)
    a = reference_quantize(torch.randn(8, 64, generator=g), "nvfp4")
    b = reference_quantize(torch.randn(16, 64, generator=g), "nvfp4")
    want = gd.gemm(a, b, backend="reference")
    exact = a.dequantize().double() @ b.dequantize().double().t()
    fp32_sum = (a.dequantize() @ b.dequantize().t()).float()
    assert gemm_bound_ratio(fp32_sum, want, a, b, "dequant") <= 1.0
    off = (exact * (1 + 1e-3)).float()
    assert gemm_bound_ratio(off, want, a, b, "dequant") > 1.0
    assert gemm_bound_ratio(want, want, a, b, "reference") == 0.0
    assert gemm_bound_ratio(fp32_sum, want, a, b, "reference") in (0.0, math.inf)


def documented_kinds() -> set[str]:
    """The kinds named in the first column of docs/testing.md's fallback table."""
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    section = text.split("## Fallbacks and their reasons", 1)[1]
    return {m[1] for m in re.finditer(r"^\| ([^|]+?) \|", section, re.M)}


def test_every_reason_kind_is_documented() -> None:
    kinds = {kind for kind, _ in REFUSALS + PLAN_REASONS}
    missing = kinds - documented_kinds()
    assert not missing, f"docs/testing.md does not list {sorted(missing)}"


def plan_reasons(recipe: Recipe, folder: Path) -> list[str]:
    """Every reason the planner gives for a recipe: kernels the templates do not generate,
    operands left unquantized, GEMM fallbacks on sm_90a and sm_100a."""
    build = prepare_builds([recipe], out=folder)[0]
    found = [item.unsupported for item in build.kernels if item.unsupported]
    found += [s.reason for s in build.plan.skipped]
    assert build.runtime is not None
    for route in build.runtime.gemms:
        for arch, what in route.routes:
            if arch == "all" or what.startswith(("no fused kernel", "no native MMA")):
                found.append(what)
    return found


def test_every_reason_the_planner_gives_is_documented(tmp_path: Path) -> None:
    """Over 40 drawn recipes, each reason the planner gives is one of the documented kinds:
    a kernel refusal (``REFUSALS``) or a plan reason (``PLAN_REASONS``)."""
    seen: set[str] = set()
    for i, case in enumerate(batch(DEFAULT_SEED, 40)):
        recipe = load_case(case, tmp_path / f"case{i}")
        if recipe is None:
            continue
        for reason in plan_reasons(recipe, tmp_path / f"gen{i}"):
            kind = refusal_kind(reason) or next(
                (k for k, p in PLAN_REASONS if re.search(p, reason)), None
            )
            assert kind is not None, f"undocumented reason: {reason}\n{case.listing()}"
            seen.add(kind)
    assert {"high precision operand", "block length", "no native sm_100a MMA"} <= seen


def test_a_kept_failure_replays_as_the_recipe_and_inputs_it_was(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """FP4GEN_FUZZ_FAILURES keeps a failing recipe's files with the seed and index of its
    inputs; replay_cases (FP4GEN_FUZZ_REPLAY) reads back the same case, seed and index."""
    import test_recipe_fuzz_gpu as fuzz

    case = RecipeCase(
        files={"main.fp4r": 'import "lib/ref.fp4r"\n# é\n', "lib/ref.fp4r": "format f = nvfp4\n"}
    )
    monkeypatch.setattr(fuzz, "REPLAYED", [(case, 1234, 17)])  # test 0 is batch 1234's 17th
    monkeypatch.setenv("FP4GEN_FUZZ_FAILURES", str(tmp_path / "kept"))
    fuzz.keep_failure("kernels", 0, "listing", case)
    monkeypatch.setattr(fuzz, "REPLAYED", None)
    ((got, seed, index),) = fuzz.replay_cases(tmp_path / "kept")
    assert (got.files, got.main, seed, index) == (case.files, case.main, 1234, 17)
    assert (tmp_path / "kept" / "kernels-0.txt").read_text() == "listing"


def test_a_failure_is_kept_as_it_happens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FP4GEN_FUZZ_FAILURES", str(tmp_path / "kept"))
    keep_failure("kernels", 7, "listing\ndifferences")
    assert (tmp_path / "kept" / "kernels-7.txt").read_text() == "listing\ndifferences"
    monkeypatch.delenv("FP4GEN_FUZZ_FAILURES")
    keep_failure("kernels", 8, "x")  # no folder: nothing written, no error
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["kernels-7.txt"]
    assert batch_digest(DEFAULT_SEED, 3) == batch_digest(DEFAULT_SEED, 3)
    assert len(batch_digest(DEFAULT_SEED, 3)) == 12
