"""``fp4gen.nn.Linear``: a drop-in torch.nn.Linear that trains with a recipe.

Forward:  y  = Q(x; fprop.activation) @ Q(W; fprop.weight)^T (+ bias)
Backward: dx = Q(dy; dgrad.gradient) @ Q(W^T; dgrad.weight)^T
          dW = Q(dy^T; wgrad.gradient) @ Q(x^T; wgrad.activation)^T
Q quantizes along the GEMM's K dimension (the last dimension of the tensor given). Every choice
comes from the recipe's operand table (as the precision schedule makes it at the current step).
A backward operand with a source (``wgrad.activation : from fprop.activation`` and the other
two pairs) is quantized from dequantize(the source copy) instead: that copy is quantized again
with its own slot (the same bits as the GEMM that reads it) and decoded in fp32 (docs/numerics.md,
section 10).

Any token count and any feature size run: a GEMM's K is zero-padded where its operands need it
(docs/numerics.md, section 3, "Padding K in fp4gen.nn.Linear"). The wgrad GEMM's K is the token
count: dy^T and x^T are padded with zero tokens to a multiple of lcm(block length, RHT size) of
the wgrad operands (dy's zero rows also reach the dgrad GEMM, whose extra output rows are
cropped); fprop's K (in_features) and dgrad's (out_features) are padded to their RHT size, where
they have one. A zero changes no amax and no code of a real element and adds 0 to every dot
product (an RHT is orthogonal), so padding adds no error of its own; a copy is made only when a
size needs it. A forward pass quantizes the fprop operands only: under torch.no_grad() or
inference_mode no wgrad constraint applies.

What a training forward saves: x's wgrad copy Q(x^T; wgrad.activation), quantized then rather
than in the backward, where it is rounded to nearest (``keeps_wgrad_input``): the backward needs
nothing else of x, and the copy takes 4.5 bits per value for NVFP4 against x's 16
(``fp4gen.runtime.ops``). Layers that read the same x in a row share one copy
(``fp4gen.runtime.shared_copy.LastCopy``). Otherwise x itself, as torch.nn.Linear does.

The jobs of a layer's calls other than its GEMM passes are mixins of ``Linear``, one module
each (docs/architecture.md): ``layer_tables``, ``operand_slots``, ``layer_amax``,
``layer_quantize``, ``shared_copy``, ``layer_graph_keys`` and ``telemetry``.

Randomness is reproducible: stochastic rounding draws Philox words keyed by the layer's seed,
with offset = STREAMS_PER_CALL * (the layer's forward or backward call count) + the operand slot,
so a rerun with the same seed and data gives the same bits. On CUDA the call count the kernels
read is a device counter per pass (``DeviceOffset``), advanced on the device by every call, so a
CUDA graph (a captured step, torch.compile's cudagraphs, the layer graphs below) draws fresh bits
on every replay: the same bits as the eager call with that count.

Layers that read one x in a row (q, k and v; gate and up) run as a layer group once two
forwards have shown them so (``fp4gen.runtime.layer_groups``): the first layer's call runs
every member's forward under one autograd node, whose backward runs every member's; each
member computes what it computes alone, and ``FP4GEN_LAYER_GROUPS=0`` turns groups off.

On CUDA the work of a forward or a backward call runs from a per-layer CUDA graph once its
shapes have been seen (``fp4gen.runtime.layer_graphs``: one graph launch instead of some 30
kernel launches from Python, the same bits); ``FP4GEN_LAYER_GRAPHS=0`` runs it eagerly.

The weight is quantized from the tensor each GEMM is given, in every forward (rowwise, for fprop)
and every backward (columnwise, for dgrad), never from a copy remembered across calls: wrappers
such as FSDP2 re-materialize the parameter in place on every all-gather, at the same address and
with the same version counter, so no pointer or version key can tell a changed weight from an
unchanged one. With 2D blocks (and the same spec for fprop and dgrad, no RHT) the backward's
columnwise weight is the transpose of the rowwise codes of the weight it is given, never
re-quantized along the other axis. Where ``fp4gen.gemm`` takes the dequantize + cuBLAS path (CUDA,
large M), a weight's bf16 values are decoded once per quantized weight
(``fp4gen.runtime.dequant.cached_bf16``). The forward bias goes into the GEMM's epilogue.
Under FSDP2's quantized weight all-gather (``fp4gen.runtime.fsdp``) the GEMMs are given the
gathered codes and scales themselves (a ``GatheredWeight``, made anew by every all-gather): they
are the fprop weight operand as they are, and their transpose the dgrad one.

Sequence- or tensor-parallel inputs (``amax_group``, ``set_amax_group``): the chosen activation
and gradient operands (default fprop.activation and dgrad.gradient) are quantized with the amax
of the whole tensor the ranks of a process group hold token slices of (one all-reduce MAX per
tensor, ``fp4gen.runtime.global_amax``), so a rank's operand is its rows of the whole batch's,
bit for bit; the activation and gradient operands then round with seed + rank * 2**20
(``data_seed``), the weights with the layer's seed. Such a layer runs eagerly (no layer graph:
a collective in a captured graph is not proven safe). docs/distributed.md says more.

Evaluation: while the layer is not training (``module.eval()``; grad mode does not matter, so a
reentrant activation checkpoint's no_grad forward runs the training formats), the forward takes
its fprop operands from the recipe's ``eval`` statement (``eval : bf16``: x and W as they are,
y = x W^T in fp32 rounded once); the backward slots stay the training ones. The eval table is a
table object of its own, so layer graphs and layer groups keyed by table identity never hand an
eval forward's graph or verdict to a training one.

Operands whose format is a Mixture-of-Representations rule (``mor NAME``) are quantized by the
MoR reference (``fp4gen.numerics.mor``) with the rule the layer was given (``mors``: the
recipe's own, plus those of recipes its schedule switches to); the columnwise MoR weight is
quantized from W^T (MoR decides per operand, as the paper applies it to tensors and their
transposes). Telemetry, when enabled, records every operand; MoR operands add the fraction of
decision units kept in high precision and a histogram of relative errors (0.5% bins).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import MoRSpec, Operand, OperandSpec, OperandTable, Recipe
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat, HighPrecision, is_stochastic
from fp4gen.gemm_dispatch import gemm
from fp4gen.numerics import QuantizedTensor
from fp4gen.runtime import finite, layer_groups, ops
from fp4gen.runtime.cute_backend import quantize_tile_cute
from fp4gen.runtime.device_memory import pooled
from fp4gen.runtime.layer_amax import AmaxGroupMember, SharedGroup
from fp4gen.runtime.layer_graph_keys import MAX_LAYOUT_PARTS as MAX_LAYOUT_PARTS
from fp4gen.runtime.layer_graph_keys import LayerGraphKeys, _Identity, _param_key
from fp4gen.runtime.layer_graphs import LayerGraphs
from fp4gen.runtime.layer_quantize import (
    OperandQuantizer,
    _dequantized,
    _gathered_operand,
    _refused_non_finite,
    _rows_contiguous,
)
from fp4gen.runtime.layer_quantize import _transposable as _transposable
from fp4gen.runtime.layer_tables import LayerTables
from fp4gen.runtime.operand_slots import FORWARD_OPERANDS as FORWARD_OPERANDS
from fp4gen.runtime.operand_slots import SLOT as SLOT
from fp4gen.runtime.operand_slots import STREAMS_PER_CALL as STREAMS_PER_CALL
from fp4gen.runtime.operand_slots import OperandSlots, _refuse_sr_capture
from fp4gen.runtime.operands import (
    k_multiple,
    mor_scope,
    operand_matmul,
    pad_to,
    quantize_operand_pair,
    round_up,
)
from fp4gen.runtime.schedule import ScheduledOperands, TrainingClock, action_mors
from fp4gen.runtime.shared_copy import CopySharing, LastCopy
from fp4gen.runtime.telemetry import Telemetry, TelemetryRecorder

# The jobs of a layer's calls live in the modules imported above, each a mixin of Linear
# (docs/architecture.md); the ``X as X`` imports re-export the names other modules and tests
# import from here. The GEMM passes and the copies they read stay here: they look ``gemm``,
# ``pad_to`` and ``quantize_operand_pair`` up in this module (tests redirect them here).
_LastCopy = LastCopy  # its name before the split
log = logging.getLogger(__name__)


class Linear(
    AmaxGroupMember,
    LayerTables,
    CopySharing,
    OperandQuantizer,
    OperandSlots,
    LayerGraphKeys,
    TelemetryRecorder,
    nn.Linear,
):
    """torch.nn.Linear whose three GEMMs run with the numerics of a recipe.

    Same constructor and state_dict as torch.nn.Linear, plus the recipe (a Recipe, a path or a
    shipped name; or an explicit operand table and the MoR rules it names), a seed for
    stochastic rounding, a name used in telemetry, and optionally a process group whose amax
    some operands share (``amax_group``, ``amax_operands``: ``set_amax_group``). A recipe's
    precision schedule follows ``fp4gen.set_step(layer, step, total_steps)``.

    As torch.nn.Linear: an input with no tokens, or a layer with no in or out features, gives
    torch's result (``_empty_linear``); a 0-d input raises TensorError. Not twice
    differentiable: a backward with create_graph=True raises FP4GenError
    (``ops.double_backward_error``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: Recipe | str | os.PathLike[str] | None = None,
        operands: OperandTable | None = None,
        seed: int = 0,
        name: str = "",
        backend: str = "auto",
        clock: TrainingClock | None = None,
        mors: Iterable[MoRSpec] = (),
        amax_group: Any = None,
        amax_operands: Iterable[Operand | str] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if (recipe is None) == (operands is None):
            raise ValueError("give exactly one of recipe= or operands=")
        if isinstance(recipe, str | os.PathLike):  # a path or a shipped name, as convert takes
            from fp4gen.dsl import load_recipe

            recipe = load_recipe(recipe)
        table = recipe.operands if recipe is not None else operands
        assert table is not None
        rules = recipe.schedule if recipe is not None else ()
        own = recipe.mors if recipe is not None else ()
        evaluation = recipe.evaluation if recipe is not None else None
        self.mors = mor_scope(
            own, mors, *(action_mors(r.action) for r in rules), action_mors(evaluation)
        )
        self.schedule = ScheduledOperands(table, rules, clock or TrainingClock(), evaluation)
        self.seed = seed
        self.name = name
        self.converted_by: str | None = None  # the recipe's name where fp4gen.convert made it
        self.check_supported()
        self.backend = backend
        self.telemetry = Telemetry()
        self._forward_calls = 0
        self._backward_calls = 0
        # device copies of the call counts (per pass and device) and the offsets that read them
        self._counters: dict[tuple[bool, torch.device], torch.Tensor] = {}
        self._device_offsets: dict[tuple[Operand, torch.device, bool], DeviceOffset] = {}
        self._graphs: LayerGraphs | None = None  # made on the first CUDA call
        # indexed by a pass's ``forward`` (0: backward, 1: forward): the operand table
        # _pass_mors last looked at and its answer, mutated in place (no Module.__setattr__)
        self._mors_seen: list[tuple[Any, tuple[bool, bool]]] = [(None, (True, True))] * 2
        # [(table, its TableFacts)] per slot (LayerTables._table_facts)
        self._table_facts_seen: list[tuple[Any, Any]] = [(None, None)] * 2
        self._last_described: list[Any] = [None, None, None]  # the layout key (_described)
        self._layout_parts: dict[tuple[Any, ...], _Identity] = {}  # interned by _described
        self._table_part: list[Any] = [None, None]  # [table, _Identity(table)] (_table_key)
        self._redrawn: list[Any] = [None, None, None]  # [table, step, resolved] (operands)
        self._copy_key_part: list[Any] = [None, None, ()]  # [table, backend, key] (_copy_key)
        self._amax_group = SharedGroup(None)
        self.amax_operands: frozenset[Operand] = frozenset()
        self._group_rank = 0
        if amax_group is not None:
            self.set_amax_group(amax_group, amax_operands)
        # training forwards save x's quantized wgrad copy instead of x (keeps_wgrad_input);
        # False saves x and quantizes the copy in the backward (the same bits, more memory)
        self.keep_quantized_input = True
        self._op_id = ops.register(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy (copy.deepcopy, pickle) is a layer of its own: the ops find a layer by its
        # id, so a copy keeping the original's id would run with the original's state
        # (schedule clock, caches) and fail once the original is gone
        super().__setstate__(state)
        self._op_id = ops.register(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> Linear:
        """Wrap an existing nn.Linear, sharing its parameters (no copy)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
            **kwargs,
        )
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, seed={self.seed}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y = x W^T (+ b) for ``weight`` [out, in] through the custom ops, any leading shape;
        from the layer's group where it has one (``fp4gen.runtime.layer_groups``)."""
        if x.dim() == 0:  # torch.nn.Linear rejects it too: there is no feature dimension
            raise TensorError(
                f"{self.name or 'Linear'}: input of shape () is 0-d; expected at least 1-D, "
                f"[..., in_features={self.in_features}]"
            )
        if x.numel() == 0 or self.out_features == 0:
            return self._empty_linear(x, weight)
        # is_compiling first: under torch.compile the ops read the mode when they run, and a
        # mode read while dynamo traces became a guard on fp4gen's module state, failed once
        # the first read had stored it (one recompile of every compiled block)
        if not torch.compiler.is_compiling() and finite.layer_mode() == "raise":
            # the tensors given are checked first, so that an error names them as given (one
            # read at the end of the call on CUDA, with the operands' checks)
            with finite.deferred():
                label = self.name or "fp4gen.nn.Linear"
                finite.check_given(x, "{}: the input of shape {}", label, x.shape)
                given = self._given_weight(weight)
                finite.check_given(given, "{}: the weight of shape {}", label, given.shape)
                return self._run(x, weight)
        return self._run(x, weight)

    @property
    def capturable(self) -> bool:
        """Whether the layer's ops may be captured into CUDA graphs: not with Mixture-of-
        Representations rules in scope, whose choice of format reads the device on the host
        (compiled as the ops inductor's graphs leave out, ``ops.linear``)."""
        return not self.mors

    def _given_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight the GEMMs read, in the layout the layer holds it (messages name it)."""
        return weight

    def _run(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``_linear`` once its input was accepted."""
        if not torch.compiler.is_compiling() and layer_groups.formed():
            grouped = layer_groups.dispatch(self, x)
            if grouped is not None:
                return grouped
        if x.shape[-1] != self.in_features:
            raise TensorError(
                f"{self.name or 'Linear'}: input of shape {tuple(x.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        x2 = x.reshape(-1, x.shape[-1])
        y = ops.linear(
            x2,
            weight,
            self.bias,
            self._op_id,
            ops.output_dtype(x),
            x.shape,
            capturable=self.capturable,
        )
        if x.dim() == 2:
            return y  # not a view, as nn.Linear's (FSDP2 warns about modules returning views)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _empty_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y for an input or output with no elements (no tokens, as an expert given none;
        in_features or out_features 0): a GEMM with an empty dimension has nothing to quantize
        and its result is exact (zeros, plus the bias), so torch.nn.Linear's computation gives
        it and its gradients (dW and the bias gradient zeros, dx empty or zeros)."""
        if x.shape[-1] != self.in_features:
            raise TensorError(
                f"{self.name or 'Linear'}: input of shape {tuple(x.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = nn.functional.linear(x, weight.to(x.dtype), bias)
        return y.to(ops.output_dtype(x))

    def __prepare_scriptable__(self) -> Linear:
        # torch.jit.script calls this on every module it scripts: say plainly that it cannot
        raise FP4GenError(
            f"{self.name or 'fp4gen.nn.Linear'}: torch.jit.script is not supported (the GEMMs "
            "are torch custom ops driven by Python state); use torch.compile or eager mode"
        )

    # --- the GEMMs, run by the custom ops in fp4gen.runtime.ops ---------------------------------
    def forward_gemm(
        self,
        x2: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        *,
        keep_wgrad_input: bool = False,
        fprop_copies: dict[Any, Any] | None = None,
    ) -> tuple[torch.Tensor, ops.WgradInput | None]:
        """fprop: y = Q(x) @ Q(W)^T (+ bias) [tokens, out], in fp32 rounded once to out_dtype
        (the GEMM's epilogue writes it). ``weight`` is the tensor the op was given (under FSDP2
        the all-gathered parameter), quantized now.

        With ``keep_wgrad_input`` (the caller saves for a backward that computes dW) and where
        ``keeps_wgrad_input`` allows, also x's wgrad copy, quantized now rather than in the
        backward (``fp4gen.runtime.ops``: what is saved); else None.

        ``fprop_copies``: x's fprop operands already made for other layers that read this very
        x, by ``fprop_input_key`` (one compiled op running the layers that read one x:
        ``fp4gen.runtime.compile_sharing``); this layer takes its operand there where it
        ``shares_fprop_input``, or leaves its own for the next."""
        table = self.operands
        if self._pass_mors(table, forward=True)[1]:
            _refuse_sr_capture(x2, (table.fprop_activation, table.fprop_weight), self.name)
        recompute = recomputing()
        call = self._backward_calls if recompute else self._forward_calls  # next_forward_call
        if recompute and self._forward_calls != call + 1 and _forward_draws(table):
            _warn_out_of_step(
                self.name,
                f"activation checkpointing recomputes a forward as call {call} after "
                f"{self._forward_calls} forward calls, with stochastically rounded operands",
            )
        keep = keep_wgrad_input and self.keeps_wgrad_input(table)
        # FSDP2's quantized all-gather (fp4gen.runtime.fsdp) hands over the quantized weight
        # itself: used as it is, eagerly (a layer graph keys the weight by its address)
        gathered = _gathered_operand(weight, table, self.name)
        graphs = None
        if gathered is None and not recompute:
            graphs = self._graphs_for(x2, table, forward=True)
        shares = fprop_copies is not None and self.shares_fprop_input(table)
        if shares and graphs is not None and x2.is_cuda and pooled(x2.device):
            graphs = None  # a capture runs a layer graph's work as it is: share the operand
        # layers reading the same x in a row (q, k and v; gate and up) share one copy, eagerly
        # or from layer graphs (the first layer's graph makes it, the others' graphs skip it)
        sharing = keep and not (x2.is_cuda and pooled(x2.device))
        share_key = self._copy_key(table) if sharing else None
        shared = _last_copy.find(x2, share_key) if sharing else None
        own = keep and shared is None  # this call quantizes x's wgrad copy itself
        if graphs is None:
            x_quantized = None
            if shares:
                assert fprop_copies is not None
                x_quantized = self._shared_fprop_input(x2, table, call, fprop_copies)
            y, xq_t = self._fprop(
                x2,
                weight,
                bias,
                out_dtype,
                table,
                call,
                gathered,
                own,
                x_quantized=x_quantized,
                recompute=recompute,
            )
            kept = None if xq_t is None else ops.WgradInput.of(xq_t, x2.dtype)
        else:
            key = (
                "fprop", x2.shape, x2.dtype, _param_key(weight), _param_key(bias), out_dtype,
                self._table_key(table), ops.context_key(), self.backend, self.seed, own,
            )  # fmt: skip

            def work(
                x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: Any = None
            ) -> Any:
                y_out = None if out is None else out[0]  # the GEMM writes y there (no copy)
                y, xq_t = self._fprop(x, w, b, out_dtype, table, call, None, own, y_out)
                if xq_t is None:
                    return (y,), None
                # packed into one (one allocation per call)
                pieces, meta = ops.graph_pieces(xq_t, None if out is None else out[1])
                return (y, *pieces), meta

            (y, *pieces), meta = graphs.run_with_meta(key, work, (x2,), (weight, bias), into=True)
            # the copy goes to the backward graph as it is: no QuantizedTensor in between
            if meta is None:
                kept = None
            else:
                layout, packing = meta
                kept = ops.WgradInput(tuple(pieces), layout, x2.dtype, packing)
        if shared is not None:
            kept = shared
            _last_copy.join(self)
        elif sharing:
            _last_copy.remember(x2, share_key, kept, self)
        elif _last_copy.run:
            _last_copy.read_alone(x2)
        if not recompute:  # not Module.__setattr__: it costs per call
            self.__dict__["_forward_calls"] = call + 1
        assert y is not None
        return y, kept

    def next_forward_call(self) -> int:
        """The call count ``forward_gemm``'s next call takes: the forward pass's, or inside a
        backward (activation checkpointing's recomputation, ``recomputing``) the backward
        pass's, that of the forward it repeats where forward and backward calls alternate."""
        return self._backward_calls if recomputing() else self._forward_calls

    def _fprop(
        self,
        x2: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        table: OperandTable,
        call: int,
        gathered: QuantizedTensor | None = None,
        keep: bool = False,
        out: torch.Tensor | None = None,
        *,
        x_quantized: Any = None,
        recompute: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """forward_gemm's work, all of it on the device where x2 is (a layer graph captures it):
        y, and with ``keep`` x's wgrad copy (else None). ``gathered``: the weight already
        quantized (FSDP2's quantized all-gather). ``out``: where the GEMM may write y (a layer
        graph's result tensor; y is then that tensor). ``x_quantized``: x's fprop operand as
        ``fprop_input`` made it for another layer of a group, where it is this layer's too.
        ``recompute``: a checkpoint's recomputation inside a backward (``forward_gemm``): the
        forward operands draw from the backward pass's counter, which holds ``call``, and the
        forward pass's counter is left as it is."""
        k = self.fprop_k(table, weight.shape[1])
        pair = None
        if keep and x_quantized is None:
            pair = self._input_pair(x2, table, call, k, recompute=recompute)
        if pair is not None:
            xq, xq_t = pair  # one read of x for both copies
        else:
            xq_t = None
            if keep:
                xq_t = self.wgrad_activation(x2, table, call, in_forward=not recompute)
            x2 = pad_to(x2, x2.shape[0], k)
            if x_quantized is None:
                xq = self.quantize(
                    x2,
                    Operand.FPROP_ACTIVATION,
                    table.fprop_activation,
                    call,
                    source_in_backward=recompute,
                )
            else:
                xq = x_quantized
        if gathered is None:
            w = pad_to(_rows_contiguous(weight.detach()), weight.shape[0], k)
            w_row = self.quantize(
                w, Operand.FPROP_WEIGHT, table.fprop_weight, call, source_in_backward=recompute
            )
        else:  # its K is never padded (fp4gen.runtime.fsdp.plan_for)
            w_row = gathered
        if not recompute:  # a recomputation records nothing twice either
            self._advance_device(forward=True)
            self.record(Operand.FPROP_ACTIVATION, x2, xq, call)
            if gathered is None:  # a gathered weight's high-precision values are not here
                self.record(Operand.FPROP_WEIGHT, w, w_row, call)
        if isinstance(xq, QuantizedTensor) and isinstance(w_row, QuantizedTensor):
            # the bias and the rounding to out_dtype in the GEMM's epilogue
            return gemm(xq, w_row, bias=bias, out_dtype=out_dtype, out=out), xq_t
        y = operand_matmul(xq, w_row)
        return (y if bias is None else y + bias.to(torch.float32)).to(out_dtype), xq_t

    def backward_gemms(
        self,
        dy2: torch.Tensor,
        x2: torch.Tensor | ops.WgradInput,
        weight: torch.Tensor,
        *,
        table: OperandTable | None = None,
        forward_call: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """dgrad and wgrad: (dx [tokens, in] in x's dtype, dW [out, in] in the weight's dtype),
        computed in fp32 and rounded once. ``weight`` is the tensor the forward op was given;
        ``x2`` the forward's input, or its wgrad copy the forward kept (``forward_gemm``).

        The operand table is the one in force now (``table``: ``operands`` as the caller just
        looked it up, else looked up here); the schedule only moves between optimizer steps, so
        it is the table the forward pass used.

        ``forward_call``: the count of the forward call whose backward this is, where the caller
        knows it (the eager autograd node): a ``from`` copy re-derives a stochastically rounded
        forward operand with the stream of the backward's count (``OperandSlots.slot``), the
        forward's where the two alternate. Where they do not (a no_grad forward in between),
        an eager backward takes ``forward_call``'s stream (a host offset); a layer graph's
        replay cannot, and that is logged once (WARNING).

        Padding (module docstring): dy and x get zero tokens up to the wgrad GEMM's multiple,
        dy and W^T zero columns up to the dgrad RHT size; dx and dW are cropped back. With sizes
        that need none, no copy is made and every bit is as without this step."""
        self.forget_shared_copy()
        if table is None:
            table = self.operands
        if self._pass_mors(table, forward=False)[1]:
            backward_specs = (
                table.dgrad_gradient,
                table.dgrad_weight,
                table.wgrad_gradient,
                table.wgrad_activation,
            )
            _refuse_sr_capture(dy2, backward_specs, self.name)
        call = self._backward_calls
        # a no_grad forward in between: the forward's operands are another call's than this
        # backward's count (only stochastically rounded sources make that matter)
        out_of_step = (
            forward_call is not None and forward_call != call and _rederives_stochastic(table)
        )
        gathered = _gathered_operand(weight, table, self.name)  # as in forward_gemm
        graphs = None if gathered is not None else self._graphs_for(dy2, table, forward=False)
        if (
            forward_call is None
            and self._forward_calls != call + 1
            and _rederives_stochastic(table)
        ):  # a compiled (or grouped) op is not told its forward's call: the counts tell
            _warn_out_of_step(
                self.name,
                f"backward call {call} runs after {self._forward_calls} forward calls and is "
                "not told its forward's call (a compiled op); if a no_grad forward came in "
                "between, its 'from' copy quantizes a stochastically rounded forward operand "
                "with another call's stream",
            )
        if out_of_step and graphs is not None:  # a replayed graph reads the pass's counter
            _warn_out_of_step(
                self.name,
                f"the backward of forward call {forward_call} runs as backward call {call} from "
                "a layer graph, and its 'from' copy quantizes a stochastically rounded forward "
                "operand again",
            )
        if graphs is None:
            source_call = forward_call if out_of_step else None
            dx, dw = self._grads(dy2, x2, weight, table, call, gathered, source_call=source_call)
        elif isinstance(x2, torch.Tensor):
            key = (
                "grads", dy2.shape, dy2.dtype, x2.shape, x2.dtype, _param_key(weight),
                self._table_key(table), ops.context_key(), self.backend, self.seed,
            )  # fmt: skip
            dx, dw = graphs.run(
                key,
                lambda dy, x, w, out=None: self._grads(dy, x, w, table, call, out=out),
                (dy2, x2),
                (weight,),
                into=True,
            )
        else:
            kept = x2
            given = kept.given
            # a round-to-nearest copy's offset names the call only: not part of the key
            described = self._described(kept.layout, kept.packing)
            key = (
                "grads", dy2.shape, dy2.dtype, described, kept.present,
                tuple([t.shape for t in given]), kept.dtype,
                _param_key(weight), self._table_key(table), ops.context_key(), self.backend,
                self.seed,
            )  # fmt: skip

            def work(dy: torch.Tensor, *rest: torch.Tensor, out: Any = None) -> tuple[Any, Any]:
                x = kept.with_given(rest[:-1])
                return self._grads(dy, x, rest[-1], table, call, out=out)

            dx, dw = graphs.run(key, work, (dy2, *given), (weight,), into=True)
        self.__dict__["_backward_calls"] = call + 1  # as in forward_gemm
        assert dx is not None and dw is not None
        return dx, dw

    def _grads(
        self,
        dy2: torch.Tensor,
        x2: torch.Tensor | ops.WgradInput,
        weight: torch.Tensor,
        table: OperandTable,
        call: int,
        gathered: QuantizedTensor | None = None,
        out: tuple[torch.Tensor | None, ...] | None = None,
        *,
        source_call: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """backward_gemms' work, all of it on the device (a layer graph captures it).
        ``gathered``: the weight already quantized rowwise; dgrad takes its transpose.
        ``out``: (dx, dW) tensors the GEMMs may write into (a layer graph's results; where no
        padding is cropped, dx and dW are then those tensors). ``source_call``: the forward
        call a ``from`` copy's source is re-derived for, where it is not ``call`` (eager)."""
        w = weight.detach()
        tokens, n_out = dy2.shape
        wgrad_k = k_multiple(table.wgrad_gradient, table.wgrad_activation, blocks=True)
        dgrad_k = k_multiple(table.dgrad_gradient, table.dgrad_weight, blocks=False)
        padded_tokens, padded_out = round_up(tokens, wgrad_k), round_up(n_out, dgrad_k)
        dy2 = pad_to(dy2, padded_tokens, padded_out)
        if gathered is None:
            w_col = self.columnwise_weight(w, table, call, padded_out, source_call=source_call)
        else:  # 2D blocks, one spec, no RHT, no padding (fp4gen.runtime.fsdp.plan_for)
            w_col = gathered.transpose()
        # dy rowwise (dgrad) and columnwise (wgrad), x columnwise (wgrad): on CUDA one tile
        # kernel per tensor reads it once, with no transposed copy. dy's zero tokens leave its
        # real rows' dgrad codes as they are (1xN blocks run along the row; an SR stream indexes
        # row * columns + column), so one padded dy serves both GEMMs.
        if self._reduced(Operand.DGRAD_GRADIENT, table.dgrad_gradient) or self._reduced(
            Operand.WGRAD_GRADIENT, table.wgrad_gradient
        ):
            # one all-reduce serves both copies (dy^T has dy's amax); each copy quantized on
            # its own, the columnwise one from dy^T as quantize_operand_pair does without a kernel
            amax = self._group_amax(dy2)
            dyq = self.quantize(dy2, Operand.DGRAD_GRADIENT, table.dgrad_gradient, call, amax)
            if table.wgrad_gradient.source is None:
                dyq_t = self.quantize(
                    dy2.t().contiguous(), Operand.WGRAD_GRADIENT, table.wgrad_gradient, call, amax
                )
            else:  # the dequantized copy has its own amax (all-reduced where the group asks)
                dyq_t = self.quantize(
                    _dequantized(dyq).t().contiguous(),
                    Operand.WGRAD_GRADIENT,
                    table.wgrad_gradient,
                    call,
                )
        elif table.wgrad_gradient.source is not None:
            # wgrad's copy from dgrad's, dequantized (exact in fp32) and quantized columnwise
            dyq = self.quantize(dy2, Operand.DGRAD_GRADIENT, table.dgrad_gradient, call)
            dyq_t = self.quantize(
                _dequantized(dyq).t().contiguous(),
                Operand.WGRAD_GRADIENT,
                table.wgrad_gradient,
                call,
            )
        else:
            dyq, dyq_t = self._quantize_pair(
                dy2,
                self.slot(Operand.DGRAD_GRADIENT, table.dgrad_gradient, call, dy2),
                self.slot(Operand.WGRAD_GRADIENT, table.wgrad_gradient, call, dy2),
                seed=self.data_seed,
            )
        dx_out, dw_out = (None, None) if out is None else out
        if padded_tokens != tokens:
            dx_out = None  # the GEMM's rows are padded: dx is a cropped view, copied out
        if padded_out != n_out:
            dw_out = None
        dx = _matmul(dyq, w_col, x2.dtype, dx_out)  # x's dtype (a WgradInput holds it)
        if padded_tokens != tokens:
            dx = dx[:tokens]  # a prefix of rows: still contiguous
        self.record(Operand.DGRAD_GRADIENT, dy2, dyq, call)
        if gathered is None:
            self.record(Operand.DGRAD_WEIGHT, w.t(), w_col, call)

        if isinstance(x2, torch.Tensor):
            xq_t = self.wgrad_activation(x2, table, call, source_call=source_call)
        else:  # quantized by the forward (keeps_wgrad_input)
            xq_t = x2.quantized
        self._advance_device(forward=False)
        dw = _matmul(dyq_t, xq_t, w.dtype, dw_out)
        if padded_out != n_out:
            dw = dw[:n_out]
        self.record(Operand.WGRAD_GRADIENT, dy2.t(), dyq_t, call)
        if isinstance(x2, torch.Tensor):
            self.record(Operand.WGRAD_ACTIVATION, x2.t(), xq_t, call)
        return dx, dw

    def wgrad_activation(
        self,
        x2: torch.Tensor,
        table: OperandTable,
        call: int,
        *,
        in_forward: bool = False,
        source_call: int | None = None,
    ) -> Any:
        """Q(x^T; wgrad.activation) for x [tokens, in], with zero tokens up to the wgrad GEMM's
        K multiple (module docstring); on CUDA a tile kernel reads x once, with no transposed
        copy. ``call``: the forward call's count where ``in_forward`` (a kept copy), else the
        backward's; ``source_call``: the forward call whose fprop copy a ``from`` copy is made
        from, where it is not ``call`` (``_grads``)."""
        wgrad_k = k_multiple(table.wgrad_gradient, table.wgrad_activation, blocks=True)
        if table.wgrad_activation.source is not None:  # from x's fprop copy, dequantized
            if source_call is None:
                fprop_copy = self.fprop_input(x2, table, call, source_in_backward=not in_forward)
            else:
                fprop_copy = self.fprop_input(x2, table, source_call, host_offset=True)
            x2 = _dequantized(fprop_copy)[:, : x2.shape[1]]
        x2 = pad_to(x2, round_up(x2.shape[0], wgrad_k), x2.shape[1])
        if self._reduced(Operand.WGRAD_ACTIVATION, table.wgrad_activation):
            return self.quantize(
                x2.t().contiguous(), Operand.WGRAD_ACTIVATION, table.wgrad_activation, call
            )
        _, xq_t = self._quantize_pair(
            x2,
            None,
            self.slot(Operand.WGRAD_ACTIVATION, table.wgrad_activation, call, x2),
            seed=self.data_seed,
        )
        return xq_t

    def _input_pair(
        self, x2: torch.Tensor, table: OperandTable, call: int, k: int, *, recompute: bool = False
    ) -> Any:
        """(x's fprop operand, x's wgrad copy) from one tile launch, where one kernel serves
        both: on CUDA, one block format for both copies, neither padded (K a whole fprop K,
        the tokens a whole wgrad K) nor taking a group's amax, the wgrad copy not made from the
        fprop one; ``k`` is the fprop GEMM's K (``fprop_k``). Else None: the caller quantizes
        them one by one (two reads of x), the same bits (the tile kernel's copies are
        ``quantize``'s of x and of x.t())."""
        fprop, wgrad = table.fprop_activation, table.wgrad_activation
        fmt = fprop.format
        if not (
            _input_pairs[0]
            and x2.is_cuda
            and self.backend != "reference"
            and isinstance(fmt, BlockFormat)
            and wgrad.format == fmt
            and wgrad.source is None
        ):
            return None
        if self._reduced(Operand.FPROP_ACTIVATION, fprop) or self._reduced(
            Operand.WGRAD_ACTIVATION, wgrad
        ):
            return None
        tokens, cols = x2.shape
        wgrad_k = k_multiple(table.wgrad_gradient, wgrad, blocks=True)
        if k != cols or tokens % wgrad_k:
            return None
        _, row = self.slot(Operand.FPROP_ACTIVATION, fprop, call, x2, source_in_backward=recompute)
        _, col = self.slot(Operand.WGRAD_ACTIVATION, wgrad, call, x2)
        outputs = (
            ("rowwise", fprop.rounding, fprop.rht, row),
            ("columnwise", wgrad.rounding, wgrad.rht, col),
        )
        return quantize_tile_cute(x2, fmt, outputs, seed=self.data_seed)

    def _quantize_pair(
        self,
        t: torch.Tensor,
        row: tuple[OperandSpec, int | DeviceOffset] | None,
        col: tuple[OperandSpec, int | DeviceOffset],
        *,
        seed: int,
    ) -> tuple[Any, Any]:
        """``quantize_operand_pair`` of ``t`` (the rowwise copy where ``row`` is given, and
        the columnwise one); where the torch reference quantizes them in a propagating scope
        (``_quantize_operand``), a NaN or an Inf in ``t`` gives both block-format copies a NaN
        global scale, as the kernels give them on CUDA."""
        if not finite.propagates() or (t.is_cuda and self.backend != "reference"):
            try:
                return quantize_operand_pair(
                    t, row, col, seed=seed, backend=self.backend, mors=self.mors
                )
            except TensorError:
                if not _refused_non_finite(t):
                    raise
                # a shape the kernels do not take went to the reference, which raised
        # the reference quantizes the copies one by one, as quantize_operand_pair does here
        rowwise = None if row is None else self._quantize_operand(t, *row, seed=seed)
        return rowwise, self._quantize_operand(t.t().contiguous(), *col, seed=seed)

    def columnwise_weight(
        self,
        w: torch.Tensor,
        table: OperandTable,
        call: int,
        k: int | None = None,
        *,
        source_call: int | None = None,
    ) -> Any:
        """Q(W^T; dgrad.weight) for this backward call, W^T [in, out] zero-padded to ``k``
        columns (the dgrad GEMM's padded K; default out_features). With 2D blocks and the fprop
        spec, the transpose of W's rowwise codes (the paper's consistency of fprop and dgrad
        weights); that spec has no RHT, so its K is never padded. With ``from fprop.weight``,
        W is first replaced by the dequantized fprop copy (zero-padded as ``_fprop`` pads it):
        that of backward call ``call``'s forward, or of forward call ``source_call``."""
        if table.dgrad_weight.source is not None:
            k_fprop = self.fprop_k(table, w.shape[1])
            w_fprop = pad_to(_rows_contiguous(w), w.shape[0], k_fprop)
            fprop_copy = self.quantize(
                w_fprop,
                Operand.FPROP_WEIGHT,
                table.fprop_weight,
                call if source_call is None else source_call,
                source_in_backward=source_call is None,
                host_offset=source_call is not None,
            )
            w = _dequantized(fprop_copy)[:, : w.shape[1]]
        if _transposable(table.fprop_weight, table.dgrad_weight) and k in (None, w.shape[0]):
            w = _rows_contiguous(w)
            if w.is_cuda and self.backend in ("auto", "cute"):
                # the 2D tile kernel writes the columnwise copy as the transpose of the rowwise
                # codes and tile scales, packed: no unpacking and transposing pass
                spec, offset = self.slot(Operand.DGRAD_WEIGHT, table.dgrad_weight, call, w)
                copies = tuple((d, spec.rounding, None, offset) for d in ("rowwise", "columnwise"))
                got = quantize_tile_cute(w, spec.format, copies, seed=self.seed)
                if got is not None:
                    return got[1]
            return self.quantize(w, Operand.DGRAD_WEIGHT, table.dgrad_weight, call).transpose()
        wt = w.t()
        wt = wt.contiguous() if k is None or k == wt.shape[1] else pad_to(wt, wt.shape[0], k)
        return self.quantize(wt, Operand.DGRAD_WEIGHT, table.dgrad_weight, call)

    def fprop_input(
        self,
        x2: torch.Tensor,
        table: OperandTable,
        call: int,
        *,
        source_in_backward: bool = False,
        host_offset: bool = False,
    ) -> Any:
        """Q(x; fprop.activation), x zero-padded to the fprop K, as ``_fprop`` makes it
        (``source_in_backward`` / ``host_offset``: again in a backward, for a ``from`` copy:
        ``OperandSlots.slot``)."""
        x2 = pad_to(x2, x2.shape[0], self.fprop_k(table))
        return self.quantize(
            x2,
            Operand.FPROP_ACTIVATION,
            table.fprop_activation,
            call,
            source_in_backward=source_in_backward,
            host_offset=host_offset,
        )

    @staticmethod
    def forget_shared_copy() -> None:
        """A backward has begun: the last forward's shared wgrad copy is not shared again."""
        if _last_copy.copy is not None or _last_copy.run:
            _last_copy.forget()


# the eager route's shared wgrad copy; runs of plain Linears that shared it are reported to
# the layer groups
_last_copy = LastCopy(plain=Linear)
_input_pairs = [True]  # x's two copies from one tile launch where one serves (_input_pair)
_warned_out_of_step: set[str] = set()  # the out-of-step warning, logged once per process


def recomputing() -> bool:
    """Whether a forward runs inside a backward: activation checkpointing recomputing it. It
    then draws the random streams of the forward it repeats (the backward's call count, from
    the backward pass's device counter on CUDA), runs eagerly and counts no forward call, so a
    checkpointed model trains bit for bit as without checkpointing."""
    return torch._C._current_graph_task_id() != -1


def _rederives_stochastic(table: OperandTable) -> bool:
    """Whether a backward quantizes a stochastically rounded forward operand again, as the
    source of a ``from`` copy (dgrad.weight from fprop.weight, wgrad.activation from
    fprop.activation; a kept wgrad copy was made in the forward, but the weight's is not)."""
    pairs = (
        (table.dgrad_weight, table.fprop_weight),
        (table.wgrad_activation, table.fprop_activation),
    )
    return any(derived.source is not None and _draws(source) for derived, source in pairs)


def _forward_draws(table: OperandTable) -> bool:
    """Whether a forward's operands draw random bits."""
    return _draws(table.fprop_activation) or _draws(table.fprop_weight)


def _draws(spec: OperandSpec) -> bool:
    """Whether quantizing with ``spec`` draws random bits (stochastic elements or scales)."""
    fmt = spec.format
    if isinstance(fmt, BlockFormat) and fmt.scale.rounding == "stochastic":
        return True
    return not isinstance(fmt, HighPrecision) and is_stochastic(spec.rounding)


def _warn_out_of_step(name: str, what: str) -> None:
    """Log once that a copy standing for a forward's draws another call's random stream."""
    if "out of step" in _warned_out_of_step:
        return
    _warned_out_of_step.add("out of step")
    log.warning(
        "%s: %s, so it draws another call's random stream than the forward it stands for: "
        "forward and backward calls do not alternate (a forward without its backward, such as "
        "a no_grad forward of a training layer). Logged once; docs/numerics.md, section 10",
        name or "fp4gen.nn.Linear",
        what,
    )


def set_input_pair_launch(enabled: bool) -> bool:
    """Whether a forward that keeps x's wgrad copy makes it and x's fprop operand in one tile
    launch where one kernel serves both (True, the default) or in two (False). Process-wide,
    read at every call; returns the previous setting. The bits are the same either way."""
    previous, _input_pairs[0] = _input_pairs[0], bool(enabled)
    return previous


class Conv1DLinear(Linear):
    """``Linear`` in place of a GPT-2 style Conv1D (``transformers.pytorch_utils.Conv1D``:
    y = x W + b with W [in, out], a linear layer with a transposed weight).

    The GEMMs run on the view W^T [out, in] (the autograd of ``.t()`` brings dW back to the
    parameter's layout); the parameter itself keeps Conv1D's [in, out] layout, so state_dict
    keys, shapes and checkpoints are those of the Conv1D. ``nf`` and ``nx`` are Conv1D's names
    for out_features and in_features."""

    @classmethod
    def from_conv1d(cls, conv: nn.Module, **kwargs: Any) -> Conv1DLinear:
        """Wrap a Conv1D, sharing its parameters (no copy)."""
        weight: torch.Tensor = conv.weight  # type: ignore[assignment]
        if weight.dim() != 2:
            raise TensorError(
                f"{kwargs.get('name') or 'Conv1D'}: expected a 2-D [in, out] weight, got shape "
                f"{tuple(weight.shape)}"
            )
        in_features, out_features = weight.shape
        layer = cls(
            in_features,
            out_features,
            bias=conv.bias is not None,
            device="meta",
            dtype=weight.dtype,
            **kwargs,
        )
        layer.weight = conv.weight  # type: ignore[assignment]
        layer.bias = conv.bias  # type: ignore[assignment]
        return layer

    @property
    def nf(self) -> int:
        return self.out_features

    @property
    def nx(self) -> int:
        return self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight.t())

    def _given_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t()  # the [in, out] parameter the GEMMs read as W^T

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight layout [in, out] (Conv1D)"


def _matmul(
    a: Any, b: Any, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A @ B^T in fp32, rounded once to out_dtype (by the GEMM's epilogue when both operands are
    quantized, written into ``out`` where given: then the result is ``out``)."""
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return gemm(a, b, out_dtype=out_dtype, out=out)
    return operand_matmul(a, b).to(out_dtype)
