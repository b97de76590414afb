"""What one generated kernel computes: the unit of code generation and caching.

A QuantKernelSpec (quantize), MoRKernelSpec (Mixture-of-Representations quantize) or
GemmKernelSpec (fused GEMM) holds every parameter that changes
the generated source, and nothing else, so equal specs share one kernel (across operands, layers
and recipes). Formats are baked into the source as constants; shapes stay dynamic.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from fp4gen.dsl.model import MoRSpec, RHTSpec
from fp4gen.formats import ElementFormat, ElementRounding, ScaleSpec, TargetError
from fp4gen.vocab import Rounding

# Short tags of the element roundings in kernel names
ROUNDING_TAGS: dict[str, str] = {
    Rounding.NEAREST.value: "rne",
    Rounding.STOCHASTIC.value: "sr",
    Rounding.STOCHASTIC16.value: "sr16",
    Rounding.STOCHASTIC8.value: "sr8",
    Rounding.ZERO.value: "rz",
}

# Literal types for type checkers: the words of fp4gen.vocab.DTYPES and vocab.Direction
InputDType = Literal["bf16", "fp16", "fp32"]
Direction = Literal["rowwise", "columnwise"]
ScaleLayout = Literal["compact", "swizzled"]


@dataclass(frozen=True)
class QuantOutput:
    """One quantized copy a kernel writes.

    rowwise: blocks along the input's last dimension, codes [M, K];
    columnwise: blocks along the first dimension, stored transposed, codes [K, M].
    Each copy has its own rounding and RHT (the paper's wgrad copies get RHT 16; gradients SR).
    """

    direction: Direction
    rounding: ElementRounding
    rht: RHTSpec | None
    scale_layout: ScaleLayout = "compact"


@dataclass(frozen=True)
class QuantKernelSpec:
    """A fused quantize kernel: one input tensor, one or two quantized copies of it.

    ``targets``, ``target_error``, ``global_bound``, ``global_rows`` and ``eden_group`` are the
    block format's options of docs/numerics.md 11 (defaults: none); the repr, and so the digest,
    names them only where they differ from the defaults, so a spec without them keeps the
    digest it always had.
    """

    element: ElementFormat
    block: tuple[int, int]  # (1, N) for 1D blocks, (N, N) for 2D tiles
    scale: ScaleSpec
    global_scale: bool
    input_dtype: InputDType
    outputs: tuple[QuantOutput, ...]
    targets: tuple[float, ...] = ()  # the block targets tried in order; (): the element's max
    target_error: TargetError = "mse"  # the error that picks a target
    global_bound: float | None = None  # the global scale's bound; None: the scale's max
    global_rows: bool = False  # one global scale per row (numerics.md 11.4)
    eden_group: int | None = None  # the MS-EDEN correction's group (numerics.md 11.3)

    def __post_init__(self) -> None:
        if not 1 <= len(self.outputs) <= 2:
            raise ValueError("a quantize kernel writes one or two copies")
        directions = [o.direction for o in self.outputs]
        if len(set(directions)) != len(directions):
            raise ValueError(f"duplicate output direction in {directions}")

    def __repr__(self) -> str:
        fields = [
            ("element", self.element),
            ("block", self.block),
            ("scale", self.scale),
            ("global_scale", self.global_scale),
            ("input_dtype", self.input_dtype),
            ("outputs", self.outputs),
        ]
        # the options only where set: the specs without them keep their repr and digest
        if self.targets:
            fields += [("targets", self.targets), ("target_error", self.target_error)]
        if self.global_bound is not None:
            fields.append(("global_bound", self.global_bound))
        if self.global_rows:
            fields.append(("global_rows", True))
        if self.eden_group is not None:
            fields.append(("eden_group", self.eden_group))
        return f"QuantKernelSpec({', '.join(f'{k}={v!r}' for k, v in fields)})"

    @property
    def name(self) -> str:
        """A readable, stable kernel name, e.g. ``quant_e2m1_1x16_e4m3rn_g_bf16_row_rne``."""
        scale = (
            self.scale.name.replace(" ", "")
            + {
                "nearest": "rn",
                "up": "ru",
                "down": "rd",
                "ocp": "ocp",
                "stochastic": "rs",
            }[self.scale.rounding]
        )
        if self.scale.element is None:
            scale = "fp32"
        block = f"{self.block[0]}x{self.block[1]}"
        if self.targets:  # e.g. 1x16t6x4 (by mse), 1x16t6x4mae
            block += "t" + "x".join(f"{t:g}" for t in self.targets)
            block += "mae" if self.target_error == "mae" else ""
        glob = "nog"
        if self.global_scale:
            glob = "grow" if self.global_rows else "g"
            glob += "" if self.global_bound is None else f"{self.global_bound:g}"
        if self.eden_group is not None:  # e.g. e4m3rs_eden128: MS-EDEN over 128 values
            scale += f"_eden{self.eden_group}"
        parts = ["quant", self.element.name.replace(" ", ""), block, scale, glob, self.input_dtype]
        for out in self.outputs:
            tag = {"rowwise": "row", "columnwise": "col"}[out.direction]
            tag += "_" + ROUNDING_TAGS[out.rounding]
            if out.rht is not None:
                tag += f"_rht{out.rht.size}"
                if out.rht.redrawn:  # signs drawn per layer or step: the kernels' arguments
                    tag += "drawn"
            if out.scale_layout == "swizzled":
                tag += "_swz"
            parts.append(tag)
        return "_".join(parts)

    @property
    def digest(self) -> str:
        """Content hash of the spec (part of the cache key)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# GEMM kernels
# ----------------------------------------------------------------------------------------------
GemmOutDType = Literal["bf16", "fp32"]


@dataclass(frozen=True)
class GemmTile:
    """The CTA tile of a fused GEMM kernel and how its warps cover it.

    One CTA computes one ``tile_m`` x ``tile_n`` output tile over all of K. ``mma_warpgroups``
    warpgroups (128 threads each) issue the wgmma and dequantize their own operands; they split
    the tile into ``mma_warpgroups / mma_n_split`` (along M) x ``mma_n_split`` (along N) wgmma
    atoms of 64 x (tile_n / mma_n_split). One producer warp loads ``stages_fp4`` k-tiles of
    packed codes and scales ahead. ``acc_sets`` independent accumulators shorten the wgmma
    dependency chain of small tiles; ``group_m`` M-tiles share one raster group (L2 reuse).
    """

    tile_m: int
    tile_n: int
    mma_warpgroups: int
    stages_fp4: int
    mma_n_split: int = 1
    acc_sets: int = 1
    group_m: int = 8

    def __post_init__(self) -> None:
        if self.tile_m not in (64, 128) or self.tile_n not in (32, 64, 128, 256):
            raise ValueError(f"tile {self.tile_m}x{self.tile_n}: M in (64, 128), N in 32..256")
        m_split, rest = divmod(self.mma_warpgroups, self.mma_n_split)
        if rest or m_split < 1:
            raise ValueError("mma_warpgroups must be a multiple of mma_n_split")
        if self.tile_m != 64 * m_split and self.mma_warpgroups != 1:
            raise ValueError(f"{m_split} warpgroups along M do not cover tile_m {self.tile_m}")
        if (self.tile_n // self.mma_n_split) % 16:
            raise ValueError("each warpgroup's N extent must be a multiple of 16")
        if self.acc_sets not in (1, 2, 4):
            raise ValueError("acc_sets must be 1, 2 or 4")
        if self.stages_fp4 < 2:
            raise ValueError("at least two fp4 stages")

    @property
    def name(self) -> str:
        """e.g. ``m64n64w1a4s12``: tile, warpgroups (``xN``: split along N), accumulator sets,
        fp4 stages."""
        name = f"m{self.tile_m}n{self.tile_n}w{self.mma_warpgroups}"
        if self.mma_n_split > 1:
            name += f"x{self.mma_n_split}"
        if self.acc_sets > 1:
            name += f"a{self.acc_sets}"
        return name + f"s{self.stages_fp4}"


@dataclass(frozen=True)
class GemmKernelSpec:
    """A fused dequantizing GEMM kernel: C = S_a S_b (A_q @ B_q^T) (+ bias) (+ C).

    A is [M, K] and B is [N, K], both quantized along K. Per operand: the element format, the
    block shape ((1, n) or (n, n), n along K) and the block-scale format (None: fp32 scales).
    Global scales are runtime tensors (1.0 for formats without one), so they are not part of the
    spec; neither is the scale rounding (it only matters when quantizing). ``accumulate``: the
    kernel adds the [M, N] output tensor it is given (C += ...). M, N, K stay dynamic.
    """

    a_element: ElementFormat
    a_block: tuple[int, int]
    a_scale: ElementFormat | None
    b_element: ElementFormat
    b_block: tuple[int, int]
    b_scale: ElementFormat | None
    out_dtype: GemmOutDType
    bias: bool
    accumulate: bool
    tile: GemmTile

    @staticmethod
    def _operand(element: ElementFormat, block: tuple[int, int], scale: ElementFormat | None):
        return f"{element.name}_{block[0]}x{block[1]}_{'fp32' if scale is None else scale.name}"

    @property
    def name(self) -> str:
        """A readable, stable kernel name, e.g.
        ``gemm_e2m1_1x16_e4m3_x_e2m1_16x16_e4m3_bf16_m64n64w1a4s12``."""
        parts = [
            "gemm",
            self._operand(self.a_element, self.a_block, self.a_scale),
            "x",
            self._operand(self.b_element, self.b_block, self.b_scale),
            self.out_dtype,
        ]
        if self.bias:
            parts.append("bias")
        if self.accumulate:
            parts.append("acc")
        parts.append(self.tile.name)
        return "_".join(parts).replace(" ", "")

    @property
    def digest(self) -> str:
        """Content hash of the spec."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Dequantize kernels (GEMM operands for cuBLAS)
# ----------------------------------------------------------------------------------------------
CodeLayout = Literal["bytes", "packed"]


@dataclass(frozen=True)
class DequantKernelSpec:
    """A dequantize kernel: codes + block-scale codes -> bf16 element x block scale.

    The operand is [R, K] quantized along K with ``block`` ((1, n) or (n, n)) blocks of
    ``element`` codes and ``scale`` block-scale codes (8 bits at most). ``codes``: "bytes" reads
    one code per byte (a QuantizedTensor's own ``codes``), "packed" two 4-bit codes per byte
    (element 0 in the low nibble; 4-bit elements only). The global scale is not applied. R and K
    stay dynamic.
    """

    element: ElementFormat
    block: tuple[int, int]
    scale: ElementFormat
    codes: CodeLayout = "bytes"

    @property
    def name(self) -> str:
        """A readable, stable kernel name, e.g. ``dequant_e2m1_1x16_e4m3_bytes``."""
        parts = [
            "dequant",
            self.element.name,
            f"{self.block[0]}x{self.block[1]}",
            self.scale.name,
            self.codes,
        ]
        return "_".join(parts).replace(" ", "")

    @property
    def digest(self) -> str:
        """Content hash of the spec."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MoRKernelSpec:
    """What the MoR kernels of one operand are generated from (``fp4gen.codegen.mor``): the rule
    (candidates, metric, threshold, partitions, scaling), the element rounding and the input."""

    rule: MoRSpec
    rounding: str = "nearest"
    input_dtype: InputDType = "bf16"
    segments: int = 4  # row segments of 8 elements per thread: CTAs of 32 * 64 / segments threads

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        rule = "".join(c if c.isalnum() else "_" for c in self.rule.name)
        return f"mor_{rule}_{self.input_dtype}_{self.rounding}_s{self.segments}_{self.digest}"
