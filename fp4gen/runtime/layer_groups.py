"""Layer groups: the Linears that read one x in a row run as one forward and one backward.

Why: in a Llama block the q, k and v projections read one x, and so do gate and up. Each
``fp4gen.nn.Linear`` call costs the host an autograd.Function call, the keys of a layer graph,
a graph launch and the allocations of its results, forward and backward; once layer graphs do
the kernels' launching, that per-call machinery is most of the host's time at small hidden
sizes (docs/training-step.md). Run as a group, seven Linears per block cost the host four calls.

What: ``fp4gen.runtime.linear`` reports every run of layers that shared one wgrad copy (the
same x, one after another: ``_LastCopy``). A run seen ``SIGHTINGS`` forwards in a row becomes a
group (``sighted``). From then on, the group's first layer (the leader), called on x in a
training forward, runs every member's forward GEMM in one autograd node (``_GroupLinear``; from
one layer graph on CUDA), and hands each other member its output when that member is called
next on the same x (``hand_over``). The node's backward runs every member's dgrad and wgrad
GEMMs (one layer graph) and sums the members' dx.

The bits are the ungrouped ones: every member's GEMMs run with its own operand table, seed and
call counts, on the one wgrad copy the ungrouped layers share; and dx is summed in the order
autograd's engine sums the separate layers' dx, the last member's first (it runs the nodes of
one input's consumers newest first: a Llama's v, k, q; up, gate), each addition rounded to dx's
dtype as the engine's is (``_sum_newest_first``). tests/test_layer_groups.py compares grouped
and ungrouped training steps bit for bit. That order is the engine's only where nothing else
reads x after the leader: an fp4gen Linear that reads x without sharing its copy keeps a run
from being reported (``_LastCopy.read_alone``), but another module reading x in between or
after (an adapter beside each projection) is not seen, and its gradient then joins the
group's sum in another order: the same terms, added in another order, so x's gradient may
differ from the ungrouped one in its last bit (every GEMM result stays the same).

When not: a member's output is handed over only when it is called on the very tensor x (the
same object, not written in place since: its version counter), with the same weight and bias
(the same tensors, same versions), grad mode and autocast. Anything else is a miss: the member
runs alone (its own, correct, output), the group is dissolved (logged once) and the output the
group made for it gets no gradient (its GEMMs contribute nothing to dx or dW). A leader that
missed ``MAX_MISSES`` times is not grouped again. A member that is not called at all before
the next leader call or a backward is a miss too. Groups run only where a stale prediction could
do harm in no way: a training forward (grad enabled) outside torch.compile's tracing, CUDA
graph captures, saved-tensor hooks (activation checkpointing recomputes a forward and must meet
the same saved tensors) and backward passes; every member a plain ``Linear`` with a plain
trainable weight, the wgrad copy kept (``Linear.keeps_wgrad_input``), no stochastic rounding
in its forward (a forward made for a member that misses draws no random stream), no MoR
operand, telemetry or amax group. ``FP4GEN_LAYER_GROUPS=0`` turns groups off.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from fp4gen.formats import is_stochastic
from fp4gen.runtime import device_memory, finite, ops
from fp4gen.runtime.layer_graphs import LayerGraphs
from fp4gen.settings import layer_groups_enabled

log = logging.getLogger("fp4gen.runtime")

SIGHTINGS = 2  # forwards in a row that show a run of layers sharing x before it is grouped
MAX_MISSES = 2  # a leader whose group missed this many times is not grouped again

# the leader of a group -> the group; every other member -> the group (modules held weakly)
_leaders: weakref.WeakKeyDictionary[Any, LayerGroup] = weakref.WeakKeyDictionary()
_members: weakref.WeakKeyDictionary[Any, LayerGroup] = weakref.WeakKeyDictionary()
# a run's first layer -> (the run, as weak references, and how many forwards in a row showed it)
_sightings: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], int]] = (
    weakref.WeakKeyDictionary()
)
_misses: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_logged: set[str] = set()


def sighted(run: Sequence[Any]) -> None:
    """A run of layers (two or more, in call order) shared one wgrad copy in a forward: count
    it, and group it once ``SIGHTINGS`` forwards in a row showed it."""
    leader = run[0]
    if not layer_groups_enabled() or leader in _leaders or _misses.get(leader, 0) >= MAX_MISSES:
        return
    if any(layer in _leaders or layer in _members for layer in run):
        return  # a layer is in a group already: the runs overlap, keep the first
    refs = tuple(weakref.ref(layer) for layer in run)
    before = _sightings.get(leader)
    count = before[1] + 1 if before is not None and before[0] == refs else 1
    if count < SIGHTINGS:
        _sightings[leader] = (refs, count)
        return
    _sightings.pop(leader, None)
    group = LayerGroup(run)
    _leaders[leader] = group
    for layer in run[1:]:
        _members[layer] = group
    for layer in run:
        layer.release_graphs()  # the group's graphs run their passes now


def formed() -> bool:
    """Whether any group exists (the per-call question every Linear asks first)."""
    return bool(_leaders) or bool(_members)


def dispatch(layer: Any, x: torch.Tensor) -> torch.Tensor | None:
    """``layer``'s output for ``x`` from its group (the leader runs the group; another member
    gets the output the group made for it), or None: the layer runs alone."""
    group = _leaders.get(layer)
    if group is not None:
        return group.lead(x)
    group = _members.get(layer)
    if group is not None and group.pending:
        return group.hand_over(layer, x)
    return None


def group_of(layer: Any) -> LayerGroup | None:
    """The group ``layer`` leads or belongs to (tests, benchmarks)."""
    return _leaders.get(layer) or _members.get(layer)


def _may_run_now(x: torch.Tensor) -> bool:
    """Whether a group may run for this call at all: a training forward outside a capture, a
    backward and saved-tensor hooks (module docstring)."""
    if not torch.is_grad_enabled() or not layer_groups_enabled():
        return False
    if torch._C._current_graph_task_id() != -1:  # inside a backward (a checkpoint recomputing)
        return False
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return False
    return not device_memory.captures(x)


class LayerGroup:
    """Sibling layers that read one x, run as one (module docstring)."""

    def __init__(self, layers: Sequence[Any]) -> None:
        self.refs = tuple(weakref.ref(layer) for layer in layers)
        self.index = {id(layer): i for i, layer in enumerate(layers)}  # of live members only
        self.name = "+".join(layer.name or f"Linear{i}" for i, layer in enumerate(layers))
        self.graphs = LayerGraphs(self.name)
        self.size = len(layers)
        # member index -> the output made for it and not yet handed over
        self.pending: dict[int, torch.Tensor] = {}
        # what the outputs were made from: x (weakly), its version, grad mode and autocast, and
        # each member's weight and bias with their versions
        self.source: tuple[Any, ...] = ()
        # the members' settings last checked (ids, objects held so ids stay theirs) -> verdict
        self._checked: tuple[list[Any], list[Any], bool] = ([], [], False)
        self.runs = 0  # group forwards run (tests, benchmarks)
        self.handed = 0  # outputs handed over to members

    def layers(self) -> tuple[Any, ...] | None:
        """The members, or None when one was deleted."""
        layers = tuple(ref() for ref in self.refs)
        return None if any(layer is None for layer in layers) else layers

    # --- forward --------------------------------------------------------------------------------
    def lead(self, x: torch.Tensor) -> torch.Tensor | None:
        """The leader's output for ``x``, every other member's made and kept for its call; None
        when the group cannot run now (the leader then runs alone)."""
        if self.pending:  # a member was not called since the last run
            self.miss("a member was not called on the x its output was made for")
            return None
        if not _may_run_now(x):
            return None
        layers = self.layers()
        if layers is None:
            self.dissolve()
            return None
        if x.shape[-1] != layers[0].in_features or not self._members_fit(layers, x):
            return None
        x2 = x.reshape(-1, x.shape[-1])
        params: list[Any] = []
        for layer in layers:
            given = layer._parameters
            params += (given["weight"], given.get("bias"))
        outputs = _GroupLinear.apply(x2, self, ops.output_dtype(x), *params)
        if x.dim() != 2:
            lead = x.shape[:-1]
            outputs = tuple(
                y.reshape(*lead, layer.out_features)
                for y, layer in zip(outputs, layers, strict=True)
            )
        self.pending = dict(enumerate(outputs[1:], start=1))
        self.source = (
            weakref.ref(x),
            x._version,
            ops.context_key(),
            [(w, w._version, b) for w, b in zip(params[0::2], params[1::2], strict=True)],
        )
        self.runs += 1
        return outputs[0]

    def hand_over(self, layer: Any, x: torch.Tensor) -> torch.Tensor | None:
        """The output the group made for ``layer`` when it is called on the same x, weight and
        context, else None (a miss: ``layer`` runs alone, the group is dissolved)."""
        index = self.index[id(layer)]  # a live member: its id is its own
        y = self.pending.pop(index, None)
        if y is None:
            return None  # called again after its output was handed over: it runs alone
        source, version, context, params = self.source
        weight, weight_version, bias = params[index]
        given = layer._parameters
        if (
            source() is not x
            or x._version != version
            or given.get("weight") is not weight
            or weight._version != weight_version
            or given.get("bias") is not bias
            or not torch.is_grad_enabled()
            or ops.context_key() != context
        ):
            self.miss("a member was called on another x, weight or context than its output's")
            return None
        self.handed += 1
        return y

    def _members_fit(self, layers: tuple[Any, ...], x: torch.Tensor) -> bool:
        """Whether every member may run in the group now (module docstring), checked again only
        when a member's settings or parameters changed (compared by identity: the objects are
        held with the verdict, so their ids stay theirs)."""
        held: list[Any] = []
        state: list[Any] = [x.get_device()]
        for layer in layers:
            params = layer._parameters
            weight, bias = params.get("weight"), params.get("bias")
            if weight is None:  # not a registered parameter now (reparametrized): run alone
                return False
            table = layer.operands  # the eval table while not training
            group = layer._amax_group.group
            held += (table, weight, bias, group)
            state += (
                id(table), id(weight), id(bias), id(group), layer.telemetry.every,
                layer.keep_quantized_input, layer.backend,
                # a parameter changes in place too: frozen, or moved by Module.to()
                weight.requires_grad, weight.get_device(),
            )  # fmt: skip
        checked, _, verdict = self._checked
        if state == checked:
            return verdict
        verdict = _fit(layers, x)
        self._checked = (state, held, verdict)
        return verdict

    def forward_pass(
        self, x2: torch.Tensor, params: tuple[Any, ...], out_dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], ops.WgradInput]:
        """Every member's y = Q(x) @ Q(W)^T (+ b) and the leader's wgrad copy of x (which the
        members share), as their ungrouped forwards make them; from one layer graph where every
        member's pass may run from one."""
        layers = self.layers()
        if layers is None:
            raise RuntimeError(f"fp4gen layer group {self.name}: a member was deleted")
        n = self.size
        tables = tuple(layer.operands for layer in layers)
        calls = tuple(layer._forward_calls for layer in layers)
        graphed = all(
            layer._graphable(x2, table, forward=True)
            for layer, table in zip(layers, tables, strict=True)
        )

        def work(x: torch.Tensor, *given: Any, out: Any = None) -> tuple[Any, Any]:
            ys = []
            copy = None
            shared: tuple[Any, Any] = (None, None)  # (what x's fprop operand depends on, it)
            for i, layer in enumerate(layers):
                # members whose fprop operand of x is the same (spec, K, backend: q, k and v
                # alike) quantize x once, with the same bits as each of them alone
                needs = layer.fprop_input_key(tables[i])
                if needs != shared[0]:
                    shared = (needs, layer.fprop_input(x, tables[i], calls[i]))
                y, made = layer._fprop(
                    x,
                    given[2 * i],
                    given[2 * i + 1],
                    out_dtype,
                    tables[i],
                    calls[i],
                    None,
                    i == 0,  # the leader quantizes x's wgrad copy, shared by all
                    None if out is None else out[i],
                    x_quantized=shared[1],
                )
                ys.append(y)
                copy = made if i == 0 else copy
            pieces, meta = ops.graph_pieces(copy, None if out is None else out[n], pack=graphed)
            return (*ys, *pieces), meta

        if graphed:
            key = (
                "group-fprop", x2.shape, x2.dtype, out_dtype, ops.context_key(),
                tuple([layer._pass_key(table, w, b) for layer, table, w, b in zip(
                    layers, tables, params[0::2], params[1::2], strict=True)]),
            )  # fmt: skip
            results, (layout, packing) = self.graphs.run_with_meta(
                key, work, (x2,), params, into=True
            )
        else:
            results, (layout, packing) = work(x2, *params)
        for layer, call in zip(layers, calls, strict=True):
            layer.__dict__["_forward_calls"] = call + 1  # not Module.__setattr__ (per call)
        kept = ops.WgradInput(tuple(results[n:]), layout, x2.dtype, packing)
        return tuple(results[:n]), kept

    # --- backward -------------------------------------------------------------------------------
    def backward_pass(
        self,
        dys: tuple[torch.Tensor | None, ...],
        kept: ops.WgradInput,
        weights: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """(dx, [dW per member]) for the members' output gradients ``dys`` (None for an output
        no gradient reached: that member adds nothing, its dW is None), as the ungrouped
        backwards compute them; from one layer graph when every member has a gradient."""
        if self.pending:  # a backward has begun: the forward is over
            self.miss("a member was not called on the x its output was made for")
        layers = self.layers()
        if layers is None:
            raise RuntimeError(f"fp4gen layer group {self.name}: a member was deleted")
        layers[0].forget_shared_copy()
        dys = tuple(dy if dy is None or dy.is_contiguous() else dy.contiguous() for dy in dys)
        tables = tuple(layer.operands for layer in layers)
        if all(dy is not None for dy in dys) and all(
            layer._graphable(dy, table, forward=False)
            for layer, table, dy in zip(layers, tables, dys, strict=True)
        ):
            return self._graphed_backward(layers, tables, dys, kept, weights)
        dxs: list[torch.Tensor] = []
        dws: list[torch.Tensor | None] = []
        for layer, dy, weight in zip(layers, dys, weights, strict=True):
            if dy is None:
                dws.append(None)
                continue
            dx, dw = layer.backward_gemms(dy, kept, weight)
            dxs.append(dx)
            dws.append(dw)
        return (_sum_newest_first(dxs) if dxs else None), dws

    def _graphed_backward(
        self,
        layers: tuple[Any, ...],
        tables: tuple[Any, ...],
        dys: tuple[torch.Tensor, ...],
        kept: ops.WgradInput,
        weights: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        n = self.size
        calls = tuple(layer._backward_calls for layer in layers)
        pieces = kept.given

        def work(*given: torch.Tensor, out: Any = None) -> tuple[torch.Tensor, ...]:
            copy = kept.with_given(given[n : n + len(pieces)])
            dxs, dws = [], []
            for i, layer in enumerate(layers):
                dw_out = None if out is None else out[1 + i]
                dx, dw = layer._grads(
                    given[i], copy, given[n + len(pieces) + i], tables[i], calls[i],
                    out=(None, dw_out),
                )  # fmt: skip
                dxs.append(dx)
                dws.append(dw)
            return (_sum_newest_first(dxs, None if out is None else out[0]), *dws)

        key = (
            "group-grads", tuple([(dy.shape, dy.dtype) for dy in dys]),
            layers[0]._described(kept.layout, kept.packing), kept.present,
            tuple([t.shape for t in pieces]), kept.dtype, ops.context_key(),
            tuple([layer._pass_key(table, w, None) for layer, table, w in zip(
                layers, tables, weights, strict=True)]),
        )  # fmt: skip
        dx, *dws = self.graphs.run(key, work, (*dys, *pieces), weights, into=True)
        for layer, call in zip(layers, calls, strict=True):
            layer.__dict__["_backward_calls"] = call + 1
        assert dx is not None
        return dx, list(dws)

    # --- misses ---------------------------------------------------------------------------------
    def miss(self, why: str) -> None:
        """A prediction failed: dissolve the group (logged once per group and reason)."""
        layers = self.layers()
        leader = None if layers is None else layers[0]
        if leader is not None:
            _misses[leader] = _misses.get(leader, 0) + 1
        message = f"fp4gen layer group {self.name} dissolved: {why}"
        if message not in _logged:
            _logged.add(message)
            log.info("%s", message)
        self.dissolve()

    def dissolve(self) -> None:
        """The members run alone from now on (until a run of them is sighted again)."""
        self.pending = {}
        self.source = ()
        for ref in self.refs:
            layer = ref()
            if layer is None:
                continue
            if _leaders.get(layer) is self:
                del _leaders[layer]
            if _members.get(layer) is self:
                del _members[layer]


def _fit(layers: tuple[Any, ...], x: torch.Tensor) -> bool:
    """Whether every member may run in a group (module docstring): a plain trainable weight on
    x's device, the same wgrad copy of x, no random stream in its forward, no MoR operand."""
    leader = layers[0]
    copy_key = leader._copy_key(leader.operands)
    for layer in layers:
        table = layer.operands
        weight = layer.weight
        if (
            type(weight) not in (torch.nn.Parameter, torch.Tensor)
            or not weight.requires_grad
            or weight.device != x.device
            or layer.in_features != leader.in_features
            or layer.amax_group is not None
            or not layer.keeps_wgrad_input(table)
            or layer._copy_key(table) != copy_key
            or is_stochastic(table.fprop_activation.rounding)
            or is_stochastic(table.fprop_weight.rounding)
            or any(layer._pass_mors(table, forward) != (False, False) for forward in (True, False))
        ):
            return False
    return True


def _sum_newest_first(dxs: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """dx of several layers as autograd's engine sums the separate layers' (module docstring):
    the newest layer's first, each addition rounded to dx's dtype; the last written into
    ``out`` where given."""
    total = dxs[-1]
    for i in range(len(dxs) - 2, -1, -1):
        if i == 0 and out is not None:
            return torch.add(total, dxs[0], out=out)
        total = total + dxs[i]
    if out is not None:
        out.copy_(total)
        return out
    return total


class _GroupLinear(torch.autograd.Function):
    """The members' forward GEMMs as one autograd node; its backward their dgrad and wgrad."""

    @staticmethod
    def forward(ctx: Any, x2: torch.Tensor, group: LayerGroup, out_dtype: torch.dtype, *params):  # type: ignore[override]
        with ops.profiled("fp4gen::group_forward"), finite.layer_scope():
            ys, kept = group.forward_pass(x2, params, out_dtype)
        ctx.save_for_backward(*params[0::2], *kept.tensors)
        ctx.kept = (kept.layout, kept.dtype, kept.packing)
        ctx.group = group
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in params[1::2])
        ctx.set_materialize_grads(False)  # an output nothing used gets None, not zeros
        return ys

    @staticmethod
    def backward(ctx: Any, *dys: torch.Tensor | None):  # type: ignore[override]
        group: LayerGroup = ctx.group
        if torch.is_grad_enabled():
            raise ops.double_backward_error(f"fp4gen layer group {group.name}")
        saved = ctx.saved_tensors
        weights, tensors = saved[: group.size], saved[group.size :]
        kept = ops.WgradInput(tuple(tensors), *ctx.kept)
        with ops.profiled("fp4gen::group_backward"), finite.layer_scope():
            if finite.layer_mode() == "raise":  # the gradients given, named (check_given)
                for ref, dy in zip(group.refs, dys, strict=True):
                    layer = ref()
                    if dy is not None and layer is not None:
                        ops.check_output_grad(layer.name, dy)
            dx, dws = group.backward_pass(dys, kept, tuple(weights))
        grads: list[torch.Tensor | None] = [dx, None, None]
        for dy, dw, bias_dtype in zip(dys, dws, ctx.bias_dtypes, strict=True):
            grads += [dw, None if dy is None else ops.bias_grad(dy, bias_dtype)]
        return tuple(grads)


__all__ = ["MAX_MISSES", "SIGHTINGS", "LayerGroup", "dispatch", "formed", "group_of", "sighted"]
