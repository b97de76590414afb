"""The recipe model: an immutable, typed description of a low-precision training recipe.

The parser (``fp4gen.dsl.parser``) builds these objects from ``.fp4r`` text, with every import and
``extends`` already resolved; the printer (``fp4gen.dsl.printer``) writes them back as canonical
text such that ``parse(print(r)) == r``. Later stages (kernel planning, runtime) read only this
model, never the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Literal

from fp4gen.formats import BlockFormat, ElementFormat, ElementRounding, HighPrecision

# --------------------------------------------------------------------------------------------
# GEMM operands of a linear layer y = x W^T (numerics contract, section 7)
# --------------------------------------------------------------------------------------------

ROLES: tuple[str, ...] = ("weight", "activation", "gradient")
GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")


class Operand(Enum):
    """One operand slot of one GEMM. The value is ``(gemm, role, use)``.

    ``use`` says how the operand's storage is read: rowwise (blocks along the tensor's last
    dimension) or columnwise (blocks along its first dimension, stored transposed).
    """

    FPROP_ACTIVATION = ("fprop", "activation", "rowwise")
    FPROP_WEIGHT = ("fprop", "weight", "rowwise")
    DGRAD_GRADIENT = ("dgrad", "gradient", "rowwise")
    DGRAD_WEIGHT = ("dgrad", "weight", "columnwise")
    WGRAD_GRADIENT = ("wgrad", "gradient", "columnwise")
    WGRAD_ACTIVATION = ("wgrad", "activation", "columnwise")

    # Plain attributes, set once per member, and the identity hash (an Enum's equality is
    # identity): the runtime reads them and keys dicts by operand on every layer call, where
    # Enum's properties and its name-hashing __hash__ cost Python calls each (a 64-expert MoE
    # layer's fwd+bwd made some 3000 of them).
    gemm: str
    role: str
    use: Literal["rowwise", "columnwise"]
    selector: str  # the recipe text that names exactly this operand, e.g. ``wgrad.gradient``
    __hash__ = object.__hash__

    def __init__(self, gemm: str, role: str, use: str) -> None:
        self.gemm, self.role, self.use = gemm, role, use  # type: ignore[assignment]
        self.selector = f"{gemm}.{role}"


# The global scale's scope in an experts module (``global per expert|tensor``): the amax of each
# expert's operand alone, or of every expert's together (docs/numerics.md 13)
GlobalScope = Literal["expert", "tensor"]
GLOBAL_SCOPES: tuple[str, ...] = ("expert", "tensor")

# Which operand may be quantized from which other copy of the same tensor (``from GEMM.ROLE``).
SOURCE_PAIRS: dict[Operand, Operand] = {
    Operand.WGRAD_ACTIVATION: Operand.FPROP_ACTIVATION,
    Operand.DGRAD_WEIGHT: Operand.FPROP_WEIGHT,
    Operand.WGRAD_GRADIENT: Operand.DGRAD_GRADIENT,
}

# --------------------------------------------------------------------------------------------
# Per-operand quantization
# --------------------------------------------------------------------------------------------

SignSource = Literal["fixed", "seeded", "none", "layer", "step"]
REDRAWN: tuple[str, ...] = ("layer", "step")  # sign sources drawn per layer (and step)
LAYER_BITS, STEP_BITS = 24, 40  # the stream of redrawn signs: layer id and step, bit widths

# Transformer Engine's fixed sign vector for d = 16 (numerics contract, section 5).
TE_SIGNS_16: tuple[int, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


@dataclass(frozen=True)
class RHTSpec:
    """Random Hadamard transform applied along the quantization direction before quantizing.

    ``signs`` holds the explicit vector when ``sign_source == "fixed"``; ``seed`` is set when it is
    ``"seeded"`` (the vector is drawn from Philox with that seed); ``"none"`` means all +1.
    ``"layer"`` and ``"step"`` draw the vector from Philox with ``seed`` and a stream of the
    layer (and the training step): a recipe holds them with ``stream`` None, and the runtime
    gives each call ``at(layer, step)`` (docs/numerics.md 12).
    """

    size: int
    sign_source: SignSource = "fixed"
    signs: tuple[int, ...] | None = TE_SIGNS_16
    seed: int | None = None
    stream: int | None = None

    def __post_init__(self) -> None:
        if self.size < 2 or self.size > 256 or self.size & (self.size - 1):
            raise ValueError(f"RHT size must be a power of two from 2 to 256, got {self.size}")
        if self.sign_source == "fixed":
            if self.signs is None or len(self.signs) != self.size:
                raise ValueError(f"a fixed RHT sign vector needs {self.size} entries")
            if any(s not in (1, -1) for s in self.signs):
                raise ValueError("RHT signs must be +1 or -1")
        elif self.sign_source in ("seeded", *REDRAWN):
            if self.seed is None or self.signs is not None:
                raise ValueError("a seeded RHT has a seed and no explicit signs")
        elif self.signs is not None or self.seed is not None:
            raise ValueError("an RHT without signs has neither a seed nor a vector")
        if self.stream is not None and (
            self.sign_source not in REDRAWN or not 0 <= self.stream < 1 << 64
        ):
            raise ValueError("only signs drawn per layer or step have a stream, in [0, 2^64)")

    @property
    def redrawn(self) -> bool:
        """Signs drawn per layer (and step): resolved per call by ``at``."""
        return self.sign_source in REDRAWN

    def at(self, layer: int, step: int) -> RHTSpec:
        """This transform for layer id ``layer`` at training step ``step``: for signs drawn per
        layer or step, the stream (layer mod 2^24) * 2^40 + (step mod 2^40) ("layer": step 0);
        any other transform as it is."""
        if not self.redrawn:
            return self
        drawn_step = step if self.sign_source == "step" else 0
        stream = (layer % (1 << LAYER_BITS)) << STEP_BITS | drawn_step % (1 << STEP_BITS)
        return replace(self, stream=stream)


@dataclass(frozen=True)
class OperandSpec:
    """Everything that decides how one GEMM operand is quantized.

    ``format`` is a block-scaled format (block shape already overridden where the recipe said
    so), a high-precision dtype, or the name of a Mixture-of-Representations rule of the recipe.
    """

    format: BlockFormat | HighPrecision | MoRRef
    rounding: ElementRounding = "nearest"
    rht: RHTSpec | None = None
    # the copy of the same tensor in another GEMM that this operand is quantized from
    # (dequantized first), so the backward sees the forward's rounded values; None: the tensor
    source: Operand | None = None
    # in an experts module, what the global amax is taken over: each expert's operand
    # ("expert", the default) or every expert's together ("tensor"); a dense layer's operand
    # is one tensor either way (docs/numerics.md 13)
    global_scope: GlobalScope = "expert"


@dataclass(frozen=True)
class OperandTable:
    """The resolved spec of each of the six GEMM operands of a linear layer."""

    fprop_activation: OperandSpec
    fprop_weight: OperandSpec
    dgrad_gradient: OperandSpec
    dgrad_weight: OperandSpec
    wgrad_gradient: OperandSpec
    wgrad_activation: OperandSpec

    def __getitem__(self, operand: Operand) -> OperandSpec:
        return getattr(self, operand.name.lower())

    def items(self) -> list[tuple[Operand, OperandSpec]]:
        return [(op, self[op]) for op in Operand]

    def redrawn(self, *, per_step: bool = False) -> bool:
        """Whether a slot's RHT signs are drawn per layer or step (``per_step``: per step)."""
        return any(
            spec.rht is not None
            and spec.rht.redrawn
            and (spec.rht.sign_source == "step" or not per_step)
            for _, spec in self.items()
        )

    def at(self, layer: int, step: int) -> OperandTable:
        """The table with every RHT's signs resolved for this layer and step (``RHTSpec.at``);
        the table itself where none is drawn per layer or step."""
        if not self.redrawn():
            return self
        resolved = {
            f.name: replace(spec, rht=None if spec.rht is None else spec.rht.at(layer, step))
            for f, (_, spec) in zip(fields(OperandTable), self.items(), strict=True)
        }
        return OperandTable(**resolved)

    @staticmethod
    def uniform(spec: OperandSpec) -> OperandTable:
        return OperandTable(**{f.name: spec for f in fields(OperandTable)})


# --------------------------------------------------------------------------------------------
# Mixture of Representations (MoR paper)
# --------------------------------------------------------------------------------------------

Granularity = Literal["tensor", "block", "channel"]
MoRScaling = Literal["gam", "e8m0", "amax"]


@dataclass(frozen=True)
class Partition:
    """How a tensor is partitioned: whole tensor, RxC blocks, or one partition per channel."""

    kind: Granularity
    block: tuple[int, int] | None = None  # set only for kind == "block"

    def __post_init__(self) -> None:
        if (self.kind == "block") != (self.block is not None):
            raise ValueError("only a block partition has a block shape")


@dataclass(frozen=True)
class Metric:
    """An acceptance test for a MoR candidate.

    kind "relerr":       mean relative error over non-zero elements < ``threshold`` (a fraction).
    kind "relerr_vs":    summed relative error < that of quantizing to ``versus``.
    kind "range":        max|x| / min|x| (non-zero) fits the candidate's normal range.
    """

    kind: Literal["relerr", "relerr_vs", "range"]
    threshold: float | None = None
    versus: ElementFormat | None = None


@dataclass(frozen=True)
class Candidate:
    """One entry of a MoR candidate list; ``metric`` is None for the final fallback."""

    format: ElementFormat | HighPrecision
    metric: Metric | None = None


@dataclass(frozen=True)
class MoRSpec:
    """A Mixture-of-Representations rule, usable as the format of any operand."""

    name: str
    decide: Partition  # granularity of the decision
    scale: Partition  # partition of the quantization scales
    scaling: MoRScaling
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True)
class MoRRef:
    """An operand format that refers to a MoR rule of the recipe by name."""

    name: str


# --------------------------------------------------------------------------------------------
# Layer rules and precision schedule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecipeRef:
    """Another recipe, as written (a path relative to the referring file)."""

    path: str
    recipe: Recipe | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class LayerSelector:
    """Which linear layers a rule covers.

    kind "first"/"last": the first or last ``count`` units, or ``fraction`` of them;
    ``unit`` is "layers" (linear modules in order) or "blocks" (repeated model blocks).
    kind "match": module names matching the glob ``pattern``.
    """

    kind: Literal["first", "last", "match"]
    unit: Literal["layers", "blocks"] | None = None
    count: int | None = None
    fraction: float | None = None
    pattern: str | None = None


LayerAction = HighPrecision | BlockFormat | RecipeRef


@dataclass(frozen=True)
class LayerRule:
    selector: LayerSelector
    action: LayerAction


@dataclass(frozen=True)
class ScheduleRule:
    """Switch a pass to another format or recipe from a step (or a fraction of training) on."""

    step: int | None
    fraction: float | None
    passes: Literal["forward", "backward", "both"]
    action: LayerAction


# --------------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    formats: tuple[tuple[str, BlockFormat | HighPrecision], ...]  # formats the recipe defines
    operands: OperandTable
    mors: tuple[MoRSpec, ...] = ()
    layers: tuple[LayerRule, ...] = ()
    schedule: tuple[ScheduleRule, ...] = ()
    # what the forward of a layer that is not training (module.eval()) runs in: None keeps the
    # fprop operands in force (``eval : fprop``); an action replaces the fprop slots with its own
    evaluation: LayerAction | None = None
    source: Path | None = field(default=None, compare=False)

    def mor(self, name: str) -> MoRSpec:
        for spec in self.mors:
            if spec.name == name:
                return spec
        raise KeyError(name)
