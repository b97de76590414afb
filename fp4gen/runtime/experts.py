"""Mixture-of-Experts layers under a recipe: ``GroupedExperts``.

transformers 5 holds the experts of a MoE layer as one module with 3-D parameters (Mixtral's
``MixtralExperts``, Qwen3-MoE's ``Qwen3MoeExperts``, gpt-oss's ``GptOssExperts``, ...): a
stacked up projection ``gate_up_proj`` (or ``up_proj``) and ``down_proj``, one slice per
expert, optional biases, and a forward ``(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]``. ``experts_layout`` recognises such a module (the grouped-experts
shape below); ``GroupedExperts`` takes its place and runs every expert's GEMMs (fprop, dgrad,
wgrad) with the recipe's operand table.

The grouped-experts shape, duck-typed (what transformers' ``use_experts_implementation``
decorator gives a class, and what any module may offer):

- 3-D parameters ``down_proj`` and ``gate_up_proj`` (``up_proj`` where ``has_gate`` is False),
  one slice per expert along dimension 0;
- ``is_transposed``: False for weights [E, out, in] (y = x W^T, Mixtral, Qwen3-MoE), True for
  [E, in, out] (y = x W, gpt-oss, Llama 4); where absent, read off the shapes (only one of the
  two readings gives an up and a down projection per slice);
- ``has_bias`` (default: whether ``<name>_bias`` parameters exist): biases ``gate_up_proj_bias``
  [E, out] and ``down_proj_bias`` [E, H];
- the activation: ``_apply_gate(gate_up)`` where gated (else ``act_fn(gate) * up`` of the two
  halves), ``act_fn`` where not;
- no other parameter, and no ``has_post_expert_norm``;
- ``zero_expert_num`` (default 0; LongcatFlash's identity "zero experts"): Z more experts after
  the E computing ones, which pass their tokens through times the routing weight; the up
  projection holds E + Z slices (the last Z unused), the down projection E;
- the forward's contract, from its signature: ``(hidden_states, top_k_index, top_k_weights)``
  (routed: the module gathers each expert's tokens, weighs and sums them), or
  ``(hidden_states)`` alone (sliced, Llama 4's ``Llama4TextExperts``: the rows [E x T, H] are
  already each expert's T tokens, expert after expert, scaled by the router; the result is
  every row's projection, [E x T, H]).

The computation is the transformers experts' own (their eager forward): for each expert with routed
tokens, in expert order, gather its tokens, y = down(gate(up(x))), scale by the routing weight and
``index_add_`` into a zero output. Each GEMM is one call of the dense layer's quantized linear op
(``fp4gen.runtime.ops.linear``) on that expert's weight slice, driven by a ``Linear`` per expert and
projection that holds no parameter: autograd, the reference numerics and every backend are the dense
layer's. Every operand is quantized per call of one expert's GEMM, so by default a weight's global
amax scale is its expert's slice (per GEMM operand, as the dense layer's); a slot the recipe takes
``global per tensor`` is quantized with the amax over every expert's operand
(``fp4gen.runtime.grouped_scope``: the loop then runs projection by projection, the backward amaxes
given by a barrier every expert's output gradient passes). Experts with no tokens run nothing (their
weights get no gradient from the step). A GEMM whose six operands the operand table keeps in the
dtype the tensors already have (nothing to round) runs as the module it replaced runs it (torch's
GEMM), so a high-precision table reproduces that module bit for bit. Where the formats allow
(``loop_reason``), each projection's GEMMs run grouped over the experts instead
(``fp4gen.runtime.grouped``: the same operands, one ``torch._grouped_mm`` per GEMM; the 1xN rowwise
operands of every expert in one grouped quantize, the others per expert).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fp4gen.dsl.model import MoRSpec, Operand, OperandTable, Recipe
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import HighPrecision
from fp4gen.runtime import ops
from fp4gen.runtime.grouped import GroupedProjection, Groups, pass_reason
from fp4gen.runtime.grouped_scope import (
    BACKWARD_SLOTS,
    FORWARD_SLOTS,
    ScopeBarrier,
    ScopedOperands,
    give_amaxes,
    scoped_slots,
)
from fp4gen.runtime.linear import Linear, recomputing
from fp4gen.runtime.operands import HP_DTYPES
from fp4gen.runtime.schedule import TrainingClock

# The GEMMs of one experts module draw their stochastic rounding from seeds
# seed + layer index + EXPERT_SEED_STRIDE * (1 + 2 * expert + projection): apart from every dense
# layer's seed (seed + layer index) and every rank's (multiples of 2**20, RANK_SEED_STRIDE).
EXPERT_SEED_STRIDE = 2**32
log = logging.getLogger(__name__)
_logged: set[str] = set()


@dataclass(frozen=True)
class ExpertsLayout:
    """How a grouped-experts module holds its weights (module docstring)."""

    num_experts: int
    up: str  # the up projection's parameter: "gate_up_proj" or "up_proj"
    gated: bool
    transposed: bool  # weights [E, in, out] (y = x W) rather than [E, out, in] (y = x W^T)
    bias: bool
    hidden: int  # H: the up projection's in features, the down projection's out features
    up_features: int  # the up projection's out features (2I where gated)
    inner: int  # I: the down projection's in features
    # forward(hidden_states [E x T, H]) -> [E x T, H], each expert its T rows (module
    # docstring); False: forward(hidden_states, top_k_index, top_k_weights), routed
    sliced: bool = False
    # experts num_experts .. num_experts + identity_experts - 1 pass their tokens through,
    # times the routing weight (the up projection holds unused slices for them)
    identity_experts: int = 0

    @property
    def weights(self) -> tuple[str, str]:
        """The two weight parameters, up then down."""
        return (self.up, "down_proj")

    @property
    def biases(self) -> tuple[str, str] | None:
        return (f"{self.up}_bias", "down_proj_bias") if self.bias else None


def experts_layout(module: nn.Module) -> ExpertsLayout | str | None:
    """The layout of a grouped-experts module; a string saying why one that holds 3-D
    ``down_proj`` and up projection parameters cannot run under a recipe; None for any other
    module."""
    params = dict(module.named_parameters(recurse=False))
    gated = getattr(module, "has_gate", "gate_up_proj" in params)
    up_name = "gate_up_proj" if gated else "up_proj"
    up, down = params.get(up_name), params.get("down_proj")
    if up is None or down is None or up.dim() != 3 or down.dim() != 3:
        return None
    kind = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        return f"{kind} applies a norm after each expert, which the grouped experts do not run"
    sliced = _sliced_contract(module)
    if isinstance(sliced, str):
        return sliced
    declared = getattr(module, "is_transposed", None)
    transposed = _transposed_shapes(up, down, gated) if declared is None else bool(declared)
    bias = bool(getattr(module, "has_bias", f"{up_name}_bias" in params))
    identity = getattr(module, "zero_expert_num", 0) or 0
    if not isinstance(identity, int) or not 0 <= identity < up.shape[0]:
        return f"{kind}.zero_expert_num is {identity!r}, its {up_name} holds {up.shape[0]} slices"
    experts = up.shape[0] - identity
    if transposed:
        hidden, up_features = up.shape[1], up.shape[2]
        inner, down_out = down.shape[1], down.shape[2]
    else:
        up_features, hidden = up.shape[1], up.shape[2]
        down_out, inner = down.shape[1], down.shape[2]
    shapes = f"{up_name} {list(up.shape)} and down_proj {list(down.shape)}"
    if down.shape[0] != experts or down_out != hidden:
        return f"{kind}'s {shapes} are not one expert's up and down projections per slice"
    if up_features != (2 * inner if gated else inner):
        times = "2x " if gated else ""
        return f"{kind}'s {shapes}: the up projection's out features are not {times}down's in"
    if getattr(module, "num_experts", experts) != experts:
        return f"{kind}.num_experts is {module.num_experts}, its {up_name} holds {experts}"
    if identity and sliced:
        return f"{kind}: identity experts belong to the routed contract"
    expected = {up_name: up.shape, "down_proj": down.shape}
    if bias:
        expected[f"{up_name}_bias"] = torch.Size([experts, up_features])
        expected["down_proj_bias"] = torch.Size([experts, hidden])
    for name, shape in expected.items():
        got = params.get(name)
        if got is None or got.shape != shape:
            found = "none" if got is None else list(got.shape)
            return f"{kind}.{name} should be {list(shape)}, found {found}"
    extra = sorted(set(params) - set(expected))
    if extra:
        return (
            f"{kind} holds parameters the grouped-experts layout does not have: {', '.join(extra)}"
        )
    gate = getattr(module, "_apply_gate", None) if gated else None
    if gate is None and not callable(getattr(module, "act_fn", None)):
        return f"{kind} has no act_fn{' or _apply_gate' if gated else ''}"
    return ExpertsLayout(
        experts, up_name, gated, transposed, bias, hidden, up_features, inner, sliced, identity
    )


def _transposed_shapes(up: torch.Tensor, down: torch.Tensor, gated: bool) -> bool:
    """Whether 3-D weights without ``is_transposed`` are [E, in, out]: only that reading gives
    a down projection back to the up projection's in features (both readings together would
    need an inner size of 0)."""
    factor = 2 if gated else 1
    as_rows = down.shape[1] == up.shape[2] and up.shape[1] == factor * down.shape[2]
    as_columns = down.shape[2] == up.shape[1] and up.shape[2] == factor * down.shape[1]
    return as_columns and not as_rows


def _sliced_contract(module: nn.Module) -> bool | str:
    """The forward's contract (module docstring) from its signature: True for
    ``forward(hidden_states)``, False for ``forward(hidden_states, top_k_index,
    top_k_weights)``, else why neither."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return f"{type(module).__name__}.forward has no signature to read"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) == 1 and len(positional) == 1:
        return True
    if len(positional) >= 3 and len(required) <= 3:
        return False
    names = ", ".join(p.name for p in params)
    return (
        f"{type(module).__name__}.forward({names}) is neither (hidden_states, top_k_index, "
        "top_k_weights) nor (hidden_states)"
    )


class _ExpertGemm(ScopedOperands, Linear):
    """One expert's projection: the dense layer's GEMMs on a weight slice it is given per call
    (its own parameters are empty, on the meta device, and belong to no model). Never run from
    a layer graph: an expert's token count changes every step, and a graph per count would be
    captured again and again. Its per-tensor slots (``global per tensor``) take the amax over
    every expert that the experts module gives it (``fp4gen.runtime.grouped_scope``)."""

    def _graphable(self, t: torch.Tensor, table: OperandTable, *, forward: bool) -> bool:
        return False


class GroupedExperts(nn.Module):
    """A grouped-experts module whose GEMMs run with a recipe's operand table (module
    docstring). It holds the replaced module's parameters, buffers and children under their
    names (the same state_dict keys and shapes, no copy) and reads its other attributes
    (``num_experts``, ``config``, the activation) from it."""

    def __init__(
        self,
        source: nn.Module,
        layout: ExpertsLayout,
        *,
        operands: OperandTable,
        seed: int,
        name: str,
        backend: str = "auto",
        clock: TrainingClock | None = None,
        mors: tuple[MoRSpec, ...] = (),
        recipe: Recipe | None = None,
    ) -> None:
        super().__init__()
        for pname, param in source.named_parameters(recurse=False):
            self.register_parameter(pname, param)
        skipped = source._non_persistent_buffers_set
        for bname, buf in source.named_buffers(recurse=False):
            self.register_buffer(bname, buf, persistent=bname not in skipped)
        for cname, child in source.named_children():
            self.add_module(cname, child)
        self.__dict__["source"] = source  # not a submodule: its parameters are ours already
        self.layout = layout
        self.name = name
        self.seed = seed
        self.converted_by: str | None = None  # the recipe's name where fp4gen.convert made it
        clock = clock or TrainingClock()
        gemms = []
        for expert in range(layout.num_experts):
            pair = []
            for proj, (pname, fan_in, fan_out) in enumerate(
                (
                    (layout.up, layout.hidden, layout.up_features),
                    ("down_proj", layout.inner, layout.hidden),
                )
            ):
                gemm = _ExpertGemm(
                    fan_in,
                    fan_out,
                    bias=False,
                    device="meta",
                    operands=operands,
                    seed=seed + EXPERT_SEED_STRIDE * (1 + 2 * expert + proj),
                    name=f"{name}.{pname}[{expert}]",
                    backend=backend,
                    clock=clock,
                    mors=mors,
                )
                if recipe is not None:  # the schedule applies to every GEMM
                    gemm.schedule.rules = recipe.schedule
                    gemm.schedule.evaluation = recipe.evaluation
                pair.append(gemm)
            gemms.append(tuple(pair))
        # not submodules: their (empty) parameters must not reach the state_dict
        self.__dict__["gemms"] = tuple(gemms)
        self._identity_seen: tuple[Any, torch.dtype | None, bool] = (None, None, False)
        # grouped GEMMs (fp4gen.runtime.grouped): None chooses (loop_reason), True takes them
        # wherever the formats allow, False runs expert by expert
        self.grouped: bool | None = None
        # every size on the device (fp4gen.runtime.static_experts): no host read of the
        # routing, so a CUDA graph of the MoE block replays any routing; off by default
        self.static: bool = False
        # called with (expert, projection, that projection's input) before each expert GEMM
        # where set (export's calibration records the inputs' amax); None: nothing
        self.observe: Callable[[int, int, torch.Tensor], None] | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            source = self.__dict__.get("source")
            if source is None or name.startswith("__"):
                raise
            return getattr(source, name)

    @property
    def operands(self) -> OperandTable:
        """The operand table in force at the current step."""
        return self.gemms[0][0].operands

    def train(self, mode: bool = True) -> GroupedExperts:
        # the GEMMs are no submodules: they follow this module's mode (the eval statement)
        super().train(mode)
        for pair in self.gemms:
            for gemm in pair:
                gemm.training = mode
        return self

    def check_supported(self) -> None:
        for pair in self.gemms:
            for gemm in pair:
                gemm.check_supported()

    def extra_repr(self) -> str:
        lay = self.layout
        return (
            f"experts={lay.num_experts}, hidden={lay.hidden}, {lay.up}={lay.up_features}, "
            f"down_proj in={lay.inner}, bias={lay.bias}, transposed={lay.transposed}, "
            f"seed={self.seed}"
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        lay = self.layout
        if hidden_states.dim() != 2 or hidden_states.shape[1] != lay.hidden:
            raise TensorError(
                f"{self.name or 'GroupedExperts'}: hidden_states of shape "
                f"{tuple(hidden_states.shape)}; expected [tokens, {lay.hidden}]"
            )
        if lay.sliced:
            if top_k_index is not None or top_k_weights is not None:
                raise TensorError(
                    f"{self.name or 'GroupedExperts'}: these experts take hidden_states alone "
                    f"(every expert's rows, expert after expert, as {type(self.source).__name__} "
                    "does); got a routing too"
                )
            if self.static:  # not served (static_reason): said, not ignored
                raise FP4GenError(
                    f"{self.name or 'GroupedExperts'}: static = True is not served: "
                    f"{self.static_reason(hidden_states)}"
                )
            if hidden_states.shape[0] % lay.num_experts:
                raise TensorError(
                    f"{self.name or 'GroupedExperts'}: hidden_states of shape "
                    f"{tuple(hidden_states.shape)}; expected [{lay.num_experts} x tokens, "
                    f"{lay.hidden}] (each expert's tokens, expert after expert)"
                )
            return self._run_slices(hidden_states)
        if top_k_index is None or top_k_weights is None:
            raise TensorError(
                f"{self.name or 'GroupedExperts'}: top_k_index and top_k_weights are needed "
                f"(the routing of {type(self.source).__name__}'s forward)"
            )
        if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
            raise TensorError(
                f"{self.name or 'GroupedExperts'}: top_k_index of shape "
                f"{tuple(top_k_index.shape)}; expected [tokens={hidden_states.shape[0]}, k]"
            )
        return self._run_experts(hidden_states, top_k_index, top_k_weights)

    # The loop depends on the routing (which experts got tokens, how many), so torch.compile
    # runs it eagerly (one graph break per MoE layer) rather than tracing it: traced, its
    # data-dependent ops broke the graph at every expert, and each expert's GEMM (its own op id,
    # a constant to dynamo) was traced again until the recompile limit
    @torch.compiler.disable
    def _run_experts(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The sum over each token's k experts of weight * down(act(up(x))), expert by expert
        (or with grouped GEMMs: ``loop_reason``)."""
        lay = self.layout
        final = torch.zeros_like(hidden_states)
        if self.static:
            return self._run_static(hidden_states, top_k_index, top_k_weights, final)
        weight = getattr(self, lay.up)
        table = self.operands
        if (
            not self._keeps_everything(table, hidden_states.dtype, weight.dtype)
            and self.loop_reason(table, hidden_states.device) is None
        ):
            final = self._run_grouped(hidden_states, top_k_index, top_k_weights, final)
            return self._add_identity(final, hidden_states, top_k_index, top_k_weights)
        with torch.no_grad():
            hit = torch.unique(top_k_index).tolist()  # sorted: experts in index order
        # not an expert-parallel sentinel (another rank's expert)
        hit = [e for e in hit if 0 <= e < lay.num_experts]
        # [k, tokens], row-major: the token order of transformers' eager loop
        routes = [torch.where((top_k_index == expert).t()) for expert in hit]
        xs = self._project_loop(hit, [hidden_states[token_idx] for _, token_idx in routes])
        for (top_k_pos, token_idx), y in zip(routes, xs, strict=True):
            y = y * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        return self._add_identity(final, hidden_states, top_k_index, top_k_weights)

    def _add_identity(
        self,
        final: torch.Tensor,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """``final`` plus the identity experts' tokens times their routing weights, expert by
        expert in index order after the computing ones (as LongcatFlash's own loop adds them)."""
        lay = self.layout
        if not lay.identity_experts:
            return final
        end = lay.num_experts + lay.identity_experts
        with torch.no_grad():
            hit = [e for e in torch.unique(top_k_index).tolist() if lay.num_experts <= e < end]
        for expert in hit:
            top_k_pos, token_idx = torch.where((top_k_index == expert).t())
            y = hidden_states[token_idx] * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        return final

    # as _run_experts: the per-expert layers' op ids are constants dynamo would trace per expert
    @torch.compiler.disable
    def _run_slices(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The sliced contract (module docstring): every expert's projections of its own T
        rows of ``hidden_states`` [E x T, H], expert after expert, grouped where
        ``loop_reason`` allows; the replaced module's own forward where the table keeps every
        operand in the tensors' dtype."""
        lay = self.layout
        table = self.operands
        if self._keeps_everything(table, hidden_states.dtype, getattr(self, lay.up).dtype):
            return type(self.source).forward(self, hidden_states)  # its bmm, its bits
        tokens = hidden_states.shape[0] // lay.num_experts
        if tokens == 0:
            return hidden_states[:0]
        experts = list(range(lay.num_experts))
        if self.loop_reason(table, hidden_states.device) is None:
            return self._project_grouped(hidden_states, experts, [tokens] * lay.num_experts)
        return torch.cat(self._project_loop(experts, list(hidden_states.split(tokens))))

    def _project_loop(self, hit: list[int], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """down(act(up(x))) of each expert in ``hit`` on its tokens ``xs``, expert by expert."""
        # projection by projection: a per-tensor slot's amax is over every expert's operand
        # (each expert's GEMMs are its own layer's: the order changes no bit)
        for proj in (0, 1):
            self._give_forward_amaxes(proj, hit, xs)
            ys = []
            for expert, x in zip(hit, xs, strict=True):
                if self.observe is not None:
                    self.observe(expert, proj, x)
                ys.append(self._gemm(expert, proj, x))
            ys = self._scope_barrier(proj, hit, xs, ys)
            xs = [self._activation(y) for y in ys] if proj == 0 else ys
        return xs

    def _weight_rows(self, proj: int, expert: int) -> torch.Tensor:
        """Expert ``expert``'s weight of projection ``proj`` as [out, in], detached."""
        w = getattr(self, self.layout.weights[proj]).detach()[expert]
        return w.t() if self.layout.transposed else w

    def _give_forward_amaxes(self, proj: int, hit: list[int], xs: list[torch.Tensor]) -> None:
        """The fprop slots' amaxes over every expert, where the table takes them per tensor."""
        layers = [pair[proj] for pair in self.gemms]
        by_expert = dict(zip(hit, xs, strict=True))

        def tensor_of(op: Operand, expert: int) -> torch.Tensor:
            return self._weight_rows(proj, expert) if op.role == "weight" else by_expert[expert]

        give_amaxes([layers[e] for e in hit], FORWARD_SLOTS, tensor_of, hit, layers)

    def _scope_barrier(
        self, proj: int, hit: list[int], xs: list[torch.Tensor], ys: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``ys`` through a ``ScopeBarrier`` where a backward slot is per tensor (its backward
        gives every expert GEMM of the projection the amaxes over all experts' gradients,
        inputs and weights before their backward runs); else ``ys``."""
        layers = [pair[proj] for pair in self.gemms]
        if not hit or not torch.is_grad_enabled():
            return ys
        scoped = scoped_slots(layers[hit[0]].operands, BACKWARD_SLOTS)
        if not scoped:
            return ys
        # the inputs are held for the backward only where their wgrad copy takes the scope
        inputs = dict(zip(hit, xs, strict=True)) if Operand.WGRAD_ACTIVATION in scoped else {}

        def give(grads: list[torch.Tensor]) -> None:
            outputs = dict(zip(hit, grads, strict=True))

            def tensor_of(op: Operand, expert: int) -> torch.Tensor:
                if op.role == "weight":
                    return self._weight_rows(proj, expert)
                return inputs[expert] if op.role == "activation" else outputs[expert]

            give_amaxes([layers[e] for e in hit], BACKWARD_SLOTS, tensor_of, hit, layers)

        return list(ScopeBarrier.apply(give, *ys))

    def _run_grouped(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        final: torch.Tensor,
    ) -> torch.Tensor:
        """``_run_experts`` with each projection's GEMMs grouped over the experts
        (``fp4gen.runtime.grouped``): the tokens sorted by expert, in the loop's order within
        each expert ([k, tokens] row-major), so every expert quantizes the rows the loop
        quantizes, in the same order (a stochastic rounding stream is indexed by position)."""
        lay = self.layout
        tokens = top_k_index.shape[0]
        flat = top_k_index.t().reshape(-1)  # k-major: the loop's order within an expert
        with torch.no_grad():
            # an expert-parallel sentinel (outside [0, E)) sorts last, as expert E; the counts
            # are the one wait for the GPU (nonzero and bincount would each add theirs: the
            # size of their output depends on the values)
            valid = (flat >= 0) & (flat < lay.num_experts)
            key = torch.where(valid, flat, lay.num_experts)
            per_key = torch.zeros(lay.num_experts + 1, dtype=torch.int64, device=key.device)
            ones = torch.ones(key.shape, dtype=torch.int64, device=key.device)
            counts = per_key.index_add_(0, key, ones).tolist()[:-1]
            order = torch.argsort(key, stable=True)[: sum(counts)]
        if not order.numel():
            return final
        token_idx, top_k_pos = order % tokens, order // tokens
        hit = [e for e in range(lay.num_experts) if counts[e]]
        x = self._project_grouped(hidden_states[token_idx], hit, [counts[e] for e in hit])
        y = x * top_k_weights[token_idx, top_k_pos, None]
        return final.index_add_(0, token_idx, y.to(final.dtype))

    def static_reason(self, hidden_states: torch.Tensor) -> str | None:
        """Why ``static`` cannot run these experts on ``hidden_states``, or None."""
        from fp4gen.runtime.static_experts import static_reason, table_reason

        lay = self.layout
        if lay.sliced:
            return "sliced experts (no routing: the grouped path's sizes are the input's own)"
        if lay.identity_experts:
            return "identity experts (their tokens are found on the host)"
        if self.observe is not None or self.gemms[0][0].telemetry.every:
            return "an observer or telemetry reads each expert's operands"
        if recomputing():
            return "activation checkpointing's recomputation (it repeats the forward's calls)"
        if self._keeps_everything(self.operands, hidden_states.dtype, hidden_states.dtype):
            return "the recipe keeps every operand in high precision"
        table = self.operands
        return table_reason(table, lay.inner, lay.hidden, bias=False) or static_reason(
            table, hidden_states, lay.up_features, bias=lay.biases is not None
        )

    def _run_static(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        final: torch.Tensor,
    ) -> torch.Tensor:
        """``_run_grouped`` with every size on the device (``static_experts``): the routing
        sorted on the device (``grouped_static.device_routing``), both projections by
        ``StaticProjection`` from the experts' device counters, every expert's call counts
        advanced per pass (an expert without tokens too: a graph cannot tell)."""
        from fp4gen.runtime.grouped_static import device_routing
        from fp4gen.runtime.static_experts import (
            backward_multiple,
            counter_calls,
            route_of,
            static_projection,
        )

        lay = self.layout
        reason = self.static_reason(hidden_states)
        if reason is not None:
            raise FP4GenError(
                f"{self.name or 'GroupedExperts'}: static = True is not served: {reason}"
            )
        tokens, k = top_k_index.shape
        device = hidden_states.device
        routing = device_routing(top_k_index, lay.num_experts, backward_multiple(self.operands))
        route = route_of(routing, lay.num_experts, tokens * k)
        x = hidden_states[routing.token_idx]
        for proj in (0, 1):
            every = [pair[proj] for pair in self.gemms]
            name = f"{self.name or 'GroupedExperts'}.{lay.weights[proj]}"
            groups = Groups(
                list(range(lay.num_experts)), [0] * lay.num_experts, every, lay.transposed,
                ops.output_dtype(x), name, every,
            )  # fmt: skip
            calls = counter_calls(every, device, self._data_seeds(proj, device))
            x = static_projection(x, getattr(self, lay.weights[proj]), route, calls, groups,
                                  counted=True)  # fmt: skip
            if proj == 0:
                x = self._activation(x)
        y = x * top_k_weights[routing.token_idx, routing.top_k_pos, None]
        return final.index_add_(0, routing.token_idx, y.to(final.dtype))

    def _data_seeds(self, proj: int, device: torch.device) -> torch.Tensor:
        """Every expert layer's data seed of projection ``proj``, int64 [E] on ``device``,
        made once (outside any capture: on the first eager call)."""
        key = (proj, device)
        seeds = self.__dict__.setdefault("_seed_tables", {})
        found = seeds.get(key)
        if found is None:
            values = [pair[proj].data_seed for pair in self.gemms]
            found = seeds[key] = torch.tensor(values, dtype=torch.int64).to(device)
        return found

    def _project_grouped(self, x: torch.Tensor, hit: list[int], counts: list[int]) -> torch.Tensor:
        """down(act(up(x))) of the rows ``x``, expert ``hit[i]``'s ``counts[i]`` rows after
        the experts' before it, with grouped GEMMs (``fp4gen.runtime.grouped``)."""
        lay = self.layout
        tables: dict = {}  # the routing's device tables, shared by both projections' groups
        for proj in (0, 1):
            if self.observe is not None:
                start = 0
                for e, count in zip(hit, counts, strict=True):
                    self.observe(e, proj, x[start : start + count])
                    start += count
            name = lay.weights[proj]
            bias = None if lay.biases is None else getattr(self, lay.biases[proj])
            groups = Groups(
                hit,
                counts,
                [self.gemms[e][proj] for e in hit],
                lay.transposed,
                ops.output_dtype(x),
                f"{self.name or 'GroupedExperts'}.{name}",
                [pair[proj] for pair in self.gemms],
                tables=tables,
            )
            x = GroupedProjection.apply(x, getattr(self, name), bias, groups)
            if proj == 0:
                x = self._activation(x)
        return x

    def loop_reason(self, table: OperandTable, device: torch.device) -> str | None:
        """Why the experts' GEMMs run expert by expert under ``table`` on ``device``, or None
        where they run grouped (``fp4gen.runtime.grouped``): ``grouped`` False turns grouped
        GEMMs off, True takes them wherever the formats allow; None (the default) takes them on
        CUDA where the dense layer's GEMM would be the dequantize path (not on sm_100a, whose
        native block-scaled MMA runs per expert), never on the float64 reference (CPU tensors,
        the reference backend). Looked at once per table, device and setting; a reason on
        CUDA is logged once."""
        backend = self.gemms[0][0].backend
        key = (table, device, self.grouped, backend, self.gemms[0][0].telemetry.every)
        seen = self.__dict__.get("_loop_seen")
        if seen is not None and seen[0] == key:
            return seen[1]
        reason = self._loop_reason(table, device, backend)
        self.__dict__["_loop_seen"] = (key, reason)
        if reason is not None and device.type == "cuda" and self.grouped is not False:
            message = (
                f"{self.name or 'GroupedExperts'}: the experts' GEMMs run per expert: {reason}"
            )
            if message not in _logged:
                _logged.add(message)
                log.info(message)
        return reason

    def _loop_reason(self, table: OperandTable, device: torch.device, backend: str) -> str | None:
        if self.grouped is False:
            return "grouped GEMMs are turned off (GroupedExperts.grouped = False)"
        if self.gemms[0][0].telemetry.every:  # enable_telemetry sets every expert's GEMMs
            return "telemetry records each expert's operands"
        reason = pass_reason(table)
        if reason is not None or self.grouped:
            return reason
        if backend == "reference":
            return "the reference backend: each GEMM is the float64 reference, per expert"
        if device.type != "cuda":
            return "CPU tensors: each GEMM is the float64 reference, as a dense layer's"
        from fp4gen.codegen.gemm_configs import NATIVE_ARCHS
        from fp4gen.compiler.jit import detect_arch

        arch = detect_arch(device)
        if arch in NATIVE_ARCHS:
            return f"{arch}: the native block-scaled MMA reads the codes, per expert"
        return None

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        source = self.source
        if not self.layout.gated:
            return source.act_fn(h)
        gate = getattr(source, "_apply_gate", None)
        if gate is not None:
            return gate(h)
        g, up = h.chunk(2, dim=-1)
        return source.act_fn(g) * up

    def _gemm(self, expert: int, proj: int, x: torch.Tensor) -> torch.Tensor:
        """One projection of one expert on its tokens x [n, in]: x W^T (+ b)."""
        lay = self.layout
        weight = getattr(self, lay.weights[proj])[expert]
        bias = None if lay.biases is None else getattr(self, lay.biases[proj])[expert]
        layer = self.gemms[expert][proj]
        if self._keeps_everything(layer.operands, x.dtype, weight.dtype):
            # nothing to round: the replaced module's own computation
            y = x @ weight if lay.transposed else nn.functional.linear(x, weight)
            return y if bias is None else y + bias
        w = weight.t() if lay.transposed else weight  # [out, in]: autograd maps dW back
        return ops.linear(
            x,
            w,
            bias,
            layer._op_id,
            ops.output_dtype(x),
            tuple(x.shape),
            capturable=layer.capturable,
        )

    def _keeps_everything(
        self, table: OperandTable, x_dtype: torch.dtype, w_dtype: torch.dtype
    ) -> bool:
        """Whether every operand of ``table`` is a high-precision format of the tensors' own
        dtype (x's and the weight's, one dtype, outside autocast): then no GEMM rounds its
        inputs. Looked at once per table and dtype."""
        if x_dtype != w_dtype or torch.is_autocast_enabled(self._device_type()):
            return False
        seen, dtype, answer = self._identity_seen
        if seen is not table or dtype != x_dtype:
            answer = all(
                isinstance(spec.format, HighPrecision) and HP_DTYPES[spec.format.name] == x_dtype
                for _, spec in table.items()
            )
            self.__dict__["_identity_seen"] = (table, x_dtype, answer)
        return answer

    def _device_type(self) -> str:
        return getattr(self, self.layout.up).device.type


def all_gemms(module: nn.Module) -> list[Linear]:
    """The per-expert GEMM layers of every ``GroupedExperts`` in ``module`` (telemetry and the
    like walk them with the model's Linears)."""
    return [
        g for m in module.modules() if isinstance(m, GroupedExperts) for p in m.gemms for g in p
    ]


__all__ = ["EXPERT_SEED_STRIDE", "ExpertsLayout", "GroupedExperts", "all_gemms", "experts_layout"]
