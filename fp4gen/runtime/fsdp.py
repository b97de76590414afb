"""Quantized weight all-gather for FSDP2: gather a weight's codes and scales instead of BF16.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) every forward and backward all-gathers each
weight in its ``param_dtype``, and ``fp4gen.nn.Linear`` then quantizes the gathered weight.
With ``enable_quantized_all_gather`` (or ``convert(..., fsdp_quantized_all_gather=True)``) a
layer's weight parameter becomes a ``ShardedWeight``: a tensor subclass that behaves as the
high-precision weight it wraps (the optimizer, the state dict and the gradient see that tensor)
and implements FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``).
Each rank then

1. casts its shard to the mixed precision policy's ``param_dtype`` (as FSDP2 would), takes its
   amax and all-reduces it (MAX, one fp32 pair: the amax and a non-finite flag) over the FSDP
   process group, so that every rank knows the amax of the whole weight;
2. quantizes its shard with that global amax, with the layer's fprop weight spec;
3. all-gathers the packed codes, the block scale codes and the per-tensor decode scale.

The layer receives a ``GatheredWeight`` (the gathered codes and scales, shaped as the weight)
and uses it directly: the fprop operand is the gathered quantized weight, the dgrad operand its
transpose (``QuantizedTensor.transpose``), and dW flows back to the unsharded parameter, whose
gradient FSDP2 reduce-scatters as usual.

Exactness: the gathered operand equals quantizing the gathered weight, bit for bit (codes,
scales and global scale). Two things make it so. The global scale depends only on the whole
weight's amax, which every rank has after the all-reduce. And every block scale and code
depends only on the elements of its block and the global scale, so a block that lies inside one
shard is quantized the same by the shard's rank as by anyone holding the whole weight. The
reference quantizer takes the global amax from the tensor it is given; each rank therefore
quantizes its shard with one extra block-row appended that holds the global amax in one
element and zeros elsewhere (``fp4gen.runtime.global_amax.quantize_with_amax``): the tensor's
amax is then the global amax, that block-row is a block of its own, and its codes and scales are
cut off again.

Where this is exact, and so used (``plan_for``, checked when a layer is enabled; the shard size
when FSDP2 first gathers):

- an exact ``fp4gen.nn.Linear`` (a Conv1D's transposed weight is not handled), whose fprop weight
  spec is the same in every operand table its precision schedule can switch to;
- 2D blocks (e.g. NVFP4 16x16), round-to-nearest, no RHT, and the dgrad weight spec equal to the
  fprop one (``_transposable``: the dgrad operand is the transpose of the fprop codes);
- FSDP2 shards dim 0 evenly on a 1-D mesh with a number of rows per rank that is a multiple of
  the block height, so that no block straddles two shards.

Anywhere else the weight is all-gathered in high precision as without this option, and the
reason is logged once per layer and reason (logger ``fp4gen.runtime``, INFO).

Bytes: for NVFP4 16x16 a rank sends 0.5 bytes per element for the codes, 1/256 for the E4M3
tile scales and 4 for the global scale, against 2 per element in BF16 (about 3.97x fewer) and 4
in fp32 (about 7.9x fewer).

Experts (``fp4gen.runtime.experts.GroupedExperts``): FSDP2 shards their 3-D parameters along
dim 0, the experts, and all-gathers them in high precision (``param_dtype``) before the experts'
GEMMs quantize each expert's slice; ``enable_quantized_all_gather`` says so once per module.

Limits: the gathered weight is read only by ``fp4gen.nn.Linear`` in eager mode (not under
torch.compile, which would have to trace the subclass); telemetry records no fprop or dgrad
weight error for a gathered weight (its high-precision values are not on the rank).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from fp4gen.dsl.model import OperandSpec
from fp4gen.errors import FP4GenError
from fp4gen.formats import BlockFormat
from fp4gen.numerics import QuantizedTensor
from fp4gen.numerics.quantize import PackedCodes
from fp4gen.runtime.global_amax import group_amax, quantize_with_amax
from fp4gen.runtime.linear import Linear, _transposable
from fp4gen.runtime.loader import LogOnce
from fp4gen.runtime.operands import k_multiple

log = logging.getLogger("fp4gen.runtime")
_log_once = LogOnce(log, "FSDP2 all-gathers a weight in high precision: %s")

aten = torch.ops.aten
EXPERTS_REASON = (
    "an experts module's 3-D weights (the quantized all-gather covers fp4gen.nn.Linear weights)"
)


@dataclass(frozen=True)
class GatherPlan:
    """How a layer's weight is all-gathered: ``spec`` is the fprop weight spec the shards are
    quantized with (None: high precision, for ``reason``). Immutable, so a deep copy of the
    model shares it safely."""

    name: str
    spec: OperandSpec | None
    reason: str = ""
    backend: str = "auto"


def plan_for(layer: Linear) -> GatherPlan:
    """The gather plan of a layer from its recipe alone (the shard size is checked later, when
    FSDP2 gathers): quantized where exact (module docstring), else high precision and why."""
    name = layer.name or "fp4gen.nn.Linear"
    if type(layer) is not Linear:
        return GatherPlan(name, None, f"{name}: a {type(layer).__name__} (only Linear)")
    # the tables the schedule can switch to; any table in force takes each slot from one of them
    tables = layer.schedule.tables()
    specs = {t.fprop_weight for t in tables} | {t.dgrad_weight for t in tables}
    if len(specs) != 1:
        why = "the fprop and dgrad weight specs differ (or the precision schedule changes them)"
        return GatherPlan(name, None, f"{name}: {why}")
    (spec,) = specs
    fmt = spec.format
    if not isinstance(fmt, BlockFormat) or not fmt.is_2d:
        why = f"the weight's format ({_spelled(fmt)}) has no 2D blocks"
        return GatherPlan(name, None, f"{name}: {why}")
    if spec.rounding != "nearest":
        return GatherPlan(name, None, f"{name}: the weight rounds {spec.rounding}, not nearest")
    if not _transposable(spec, spec):
        return GatherPlan(name, None, f"{name}: the weight has an RHT")
    # the gathered operand is the unpadded weight: neither GEMM may pad its K
    others = {t.fprop_activation for t in tables} | {t.dgrad_gradient for t in tables}
    if any(k_multiple(other, spec, blocks=False) != 1 for other in others):
        return GatherPlan(name, None, f"{name}: a GEMM of the weight pads its K (an RHT)")
    return GatherPlan(name, spec, backend=layer.backend)


def _spelled(fmt: Any) -> str:
    block = getattr(fmt, "block", None)
    name = getattr(fmt, "name", str(fmt))
    return f"{name} {block[0]}x{block[1]}" if block else name


def enable_quantized_all_gather(model: nn.Module) -> list[GatherPlan]:
    """Give every ``fp4gen.nn.Linear`` of ``model`` the quantized weight all-gather, before
    ``fully_shard``: its weight becomes a ``ShardedWeight`` parameter around the same tensor (no
    copy). Layers where it is not exact keep the high-precision all-gather, said once when
    FSDP2 first gathers them. An experts module (``GroupedExperts``) keeps it too, said once
    now: FSDP2 shards and gathers its 3-D parameters as they are. Returns each layer's plan
    (an experts module's among them), in module order."""
    from fp4gen.runtime.experts import GroupedExperts  # imports this module's Linear too

    plans = []
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            # FSDP2 shards its 3-D parameters along the experts and gathers them as they are
            name = module.name or "GroupedExperts"
            plan = GatherPlan(name, None, f"{name}: {EXPERTS_REASON}")
            _log_once(plan.reason)
            plans.append(plan)
            continue
        if not isinstance(module, Linear):
            continue
        weight = module.weight
        if isinstance(weight, ShardedWeight):
            plans.append(weight.plan)
            continue
        if type(weight).__name__ == "DTensor":  # no import: torch may lack torch.distributed
            raise FP4GenError(
                f"{module.name or 'fp4gen.nn.Linear'}: enable the quantized all-gather before "
                "fully_shard (its weight is already sharded)"
            )
        plan = plan_for(module)
        module.weight = nn.Parameter(
            ShardedWeight(weight.detach(), plan), requires_grad=weight.requires_grad
        )
        module.register_state_dict_post_hook(_plain_state_dict)
        plans.append(plan)
    return plans


def _plain_state_dict(module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
    """A state dict holds the weight as the plain tensor a ShardedWeight wraps (as a DTensor of
    it under FSDP2), so that checkpoints load anywhere (``torch.load(weights_only=True)``
    refuses unknown tensor classes) and the option changes nothing in them."""
    key = prefix + "weight"
    value = state.get(key)
    if isinstance(value, ShardedWeight):
        state[key] = value._inner
    elif isinstance(getattr(value, "_local_tensor", None), ShardedWeight):
        from torch.distributed.tensor import DTensor

        assert isinstance(value, DTensor)
        state[key] = DTensor.from_local(
            value._local_tensor._inner,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )


def _quantize_shard(
    shard: torch.Tensor, spec: OperandSpec, amax: torch.Tensor, backend: str
) -> QuantizedTensor:
    """Q(shard) with the whole weight's amax ``amax`` in place of the shard's (round to nearest:
    no random stream). The block height divides the shard's rows (the caller checks)."""
    return quantize_with_amax(shard, spec, amax, seed=0, offset=0, backend=backend)


# --- the sharded parameter -----------------------------------------------------------------------
# ops whose result is still the (sharded) weight, or a view or copy of it: FSDP2 chunks, pads,
# narrows, views and copies the parameter while sharding it and moving it between devices
_KEEP_SUBCLASS = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.empty_like.default,
    aten.clone.default,
    aten.copy_.default,
    aten._to_copy.default,
    aten._pin_memory.default,
}


class ShardedWeight(torch.Tensor):
    """A weight parameter (the whole weight, or under FSDP2 the rank's shard) that FSDP2
    all-gathers quantized where ``plan`` says so (module docstring).

    It stands for the high-precision tensor ``_inner`` it wraps: every torch op runs on that
    tensor; the ops FSDP2 uses to shard and move a parameter (``_KEEP_SUBCLASS``) give another
    ShardedWeight with the same plan, any other op a plain tensor."""

    _inner: torch.Tensor
    plan: GatherPlan

    @staticmethod
    def __new__(cls, inner: torch.Tensor, plan: GatherPlan) -> ShardedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=inner.device,
            layout=inner.layout,
            requires_grad=inner.requires_grad,
        )

    def __init__(self, inner: torch.Tensor, plan: GatherPlan) -> None:
        self._inner = inner
        self.plan = plan

    def __repr__(self) -> str:
        return f"ShardedWeight({self._inner!r}, quantized={self.plan.spec is not None})"

    def __tensor_flatten__(self) -> tuple[list[str], GatherPlan]:
        return ["_inner"], self.plan

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor], plan: GatherPlan, outer_size: Any, outer_stride: Any
    ) -> ShardedWeight:
        return ShardedWeight(inner_tensors["_inner"], plan)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat, _ = tree_flatten((args, kwargs))
        plan = next(a.plan for a in flat if isinstance(a, ShardedWeight))
        out = func(
            *tree_map_only(ShardedWeight, lambda t: t._inner, args),
            **tree_map_only(ShardedWeight, lambda t: t._inner, kwargs or {}),
        )
        if func not in _KEEP_SUBCLASS:
            return out
        return tree_map_only(torch.Tensor, lambda t: ShardedWeight(t, plan), out)

    # --- FSDP2's all-gather extension ----------------------------------------------------------
    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's all-gather inputs: (packed codes, scale codes or fp32 scales, the fp32
        global decode scale [1]) of the shard quantized with the global amax, or the shard in
        ``param_dtype`` where the plan or the shard size makes that inexact."""
        dtype = mp_policy.param_dtype or self.dtype
        shard = self._inner.to(dtype)
        reason = self._gather_reason(mesh, outer_size)
        if reason:
            _log_once(reason)
            # FSDP2 gathers equal shards: the last ranks' are padded with zero rows
            rows = -(-outer_size[0] // mesh.size())
            if shard.shape[0] != rows:
                shard = torch.cat(
                    (shard, shard.new_zeros((rows - shard.shape[0], *shard.shape[1:])))
                )
            return (shard,), None
        spec = self.plan.spec
        assert spec is not None
        # One all-reduce: the amax of the whole weight, NaN on every rank when any shard holds
        # a NaN or an Inf (fp4gen.runtime.global_amax.group_amax), so that every rank does what
        # the layer does with a non-finite weight rather than one raising while the others
        # wait in the all-gather.
        amax = group_amax(shard, mesh.get_group())
        q = _quantize_shard(shard.contiguous(), spec, amax, self.plan.backend)
        scales = q.scale_codes if q.scale_codes is not None else q.scales
        global_scale = q.global_scale.reshape(1).to(torch.float32)
        return (q.data, scales, global_scale), (q.format, q.cols, dtype)

    def _gather_reason(self, mesh: Any, outer_size: torch.Size) -> str:
        """Why the shard is gathered in high precision ("" when it is gathered quantized)."""
        plan = self.plan
        if plan.spec is None:
            return plan.reason
        if mesh.ndim != 1:
            return f"{plan.name}: a {mesh.ndim}-D mesh (only 1-D FSDP meshes)"
        world = mesh.size()
        if world == 1:
            # FSDP2 skips the all-gather on one rank and hands over its first input alone; the
            # shard is the whole weight, which the layer quantizes as without FSDP2
            return f"{plan.name}: one rank, nothing to gather"
        height = plan.spec.format.block[0]  # type: ignore[union-attr]
        rows = outer_size[0]
        if rows % world or (rows // world) % height:
            return (
                f"{plan.name}: {rows} rows on {world} ranks is not a multiple of the "
                f"{height}-row block per rank, so blocks would straddle shards"
            )
        return ""

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The unsharded weight: a GatheredWeight over the gathered codes and scales, or the
        gathered high-precision tensor. With ``out`` (every gather after the first, into the
        same buffers) the existing GatheredWeight takes the new global scale."""
        if metadata is None:  # high precision: the output is the weight itself
            (weight,) = all_gather_outputs
            return None if out is not None else (weight, ())
        fmt, cols, dtype = metadata
        data, scales, global_scales = all_gather_outputs
        parts = _GatheredParts(fmt, data, scales, global_scales, cols, dtype)
        if out is not None:
            assert isinstance(out, GatheredWeight)
            out._parts[0] = parts
            return None
        return GatheredWeight([parts]), ()


@dataclass(frozen=True)
class _GatheredParts:
    """The all-gather outputs of one quantized weight: packed codes [R, packed cols], block scale
    codes (or fp32 scales) [R / block height, column blocks], the ranks' global decode scales
    [world] (all equal)."""

    format: BlockFormat
    data: torch.Tensor
    scales: torch.Tensor
    global_scales: torch.Tensor
    cols: int
    dtype: torch.dtype

    def operand(self) -> QuantizedTensor:
        """The gathered weight as a QuantizedTensor (made per call: its unpacked codes and
        decoded scales are derived on read and must not outlive the gathered buffers)."""
        coded = self.format.scale.element is not None
        return QuantizedTensor(
            codes=None,
            scales=None if coded else self.scales,
            scale_codes=self.scales if coded else None,
            global_scale=self.global_scales[0],
            format=self.format,
            rounding="nearest",
            rht=None,
            seed=0,
            offset=0,
            shape=torch.Size((self.data.shape[0], self.cols)),
            dtype=self.dtype,
            packed=PackedCodes(self.data, self.cols, self.format.element.bits),
        )


class GatheredWeight(torch.Tensor):
    """The all-gathered weight of a layer, quantized: shaped [out, in] and typed as the weight in
    ``param_dtype``, holding the gathered codes and scales (no high-precision values). Only
    ``fp4gen.nn.Linear`` reads it (``quantized_weight``); FSDP2 aliases it (detach, views of the
    same shape), which share the gathered parts; other ops raise FP4GenError, except
    ``zeros_like`` / ``empty_like`` (FSDP2's zero gradient), which give plain tensors."""

    _parts: list[_GatheredParts]  # a one-item box: aliases share it, a regather updates it

    @staticmethod
    def __new__(cls, box: list[_GatheredParts]) -> GatheredWeight:
        parts = box[0]
        shape = torch.Size((parts.data.shape[0], parts.cols))
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=parts.dtype, device=parts.data.device, requires_grad=False
        )

    def __init__(self, box: list[_GatheredParts]) -> None:
        self._parts = box

    def __repr__(self) -> str:
        parts = self._parts[0]
        return f"GatheredWeight({tuple(self.shape)}, {parts.format.name} {parts.format.block})"

    def quantized_weight(self) -> QuantizedTensor:
        """The fprop operand: the gathered weight quantized rowwise (its transpose is dgrad's)."""
        parts = self._parts[0]
        return parts.operand()

    def dequantize(self) -> torch.Tensor:
        """The gathered weight's values (fp32), for inspection."""
        return self.quantized_weight().dequantize()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        this = args[0]
        assert isinstance(this, GatheredWeight)
        if func in (aten.detach.default, aten.alias.default):
            return GatheredWeight(this._parts)
        if func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(
            this.shape
        ):
            return GatheredWeight(this._parts)
        if func in (aten.zeros_like.default, aten.empty_like.default):
            dtype = kwargs.get("dtype") or this.dtype
            return torch.zeros(this.shape, dtype=dtype, device=kwargs.get("device", this.device))
        raise FP4GenError(
            f"{func}: the all-gathered quantized weight holds codes and scales only and is read "
            "by fp4gen.nn.Linear alone (turn off the quantized all-gather to use other ops)"
        )


__all__ = [
    "GatherPlan",
    "GatheredWeight",
    "ShardedWeight",
    "enable_quantized_all_gather",
    "plan_for",
]
