"""Under torch.compile (inductor), the fp4gen ops that read one x share its quantized copies.

The custom ops run each layer alone, so the layers that read one x (a Llama's q, k and v; gate
and up) would each quantize it: in the forward for fprop, in the backward for wgrad. Whether two
ops read one x cannot be decided when they run: inductor writes a later tensor into a buffer it
reuses (the same Python object, the same address, no version bump). The graph decides it. This
pass runs over each post-grad graph inductor compiles (``torch._inductor.config``'s
``post_grad_custom_pre_pass``) and merges

- the ``fp4gen::linear_forward`` nodes whose x is one value (the same node, through views of
  equal shape, stride and offset; the post-grad graph is functional) into one
  ``fp4gen::linear_forward_group`` node before the first of them: it runs the layers in their
  order, and those whose fprop operand is the same (``Linear.shares_fprop_input``, an equal
  ``fprop_input_key``) take the first one's;
- the ``fp4gen::linear_backward`` nodes whose x is one value into one
  ``fp4gen::linear_backward_group`` node where the last of them was (the nodes between that used
  the earlier ones' results move after it; a group is cut where a later node's inputs depend on
  an earlier one's results): the layers whose wgrad copy is the same
  (``Linear.keeps_wgrad_input``, an equal ``_copy_key``) take one copy, made once.

Each shared copy is a local of one op call: it dies inside the call, so nothing is kept across
ops (nothing lands in a CUDA graph's pool past the graph). Only round-to-nearest copies are
shared, so the bits are each layer's own. ``install`` puts the pass in place (the ops' fake
kernels call it while torch.compile traces, before inductor's passes run); a pass the user set
there runs first. torch.compile without inductor (``backend="aot_eager"``) shares nothing.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

log = logging.getLogger(__name__)

# views that give the same value for the same base and the same shape, stride and offset
_VIEWS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.as_strided.default,
}


def _value_key(node: Any) -> tuple[Any, ...] | None:
    """What makes two nodes' tensors one value: the node they view (through view ops) and the
    tensor's shape, stride, offset and dtype; None where the node's tensor is unknown."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    base = node
    while base.op == "call_function" and base.target in _VIEWS:
        base = base.args[0]
    layout = (*val.shape, None, *val.stride(), None, val.storage_offset())
    return (base, tuple(_symbolic(v) for v in layout), val.dtype)


def _symbolic(v: Any) -> Any:
    """A size as a hashable value: a symbolic size (dynamic shapes) as its expression."""
    return v.node.expr if isinstance(v, torch.SymInt) else v


def _groups(nodes: Iterable[fx.Node], key_of) -> list[list[fx.Node]]:
    """The nodes with an equal key (not None), two or more, each group in graph order."""
    found: dict[Any, list[fx.Node]] = {}
    for node in nodes:
        key = key_of(node)
        if key is not None:
            found.setdefault(key, []).append(node)
    return [group for group in found.values() if len(group) > 1]


def _merge_forwards(graph: fx.Graph, position: dict[fx.Node, int]) -> int:
    """Merge each group of forward ops on one x; returns how many ops were merged away."""
    forwards = [
        n
        for n in graph.nodes
        if n.target is torch.ops.fp4gen.linear_forward.default and len(n.args) == 5
    ]

    def key_of(node: fx.Node) -> Any:
        x = _value_key(node.args[0])
        return None if x is None else (x, node.args[4])

    merged = 0
    for group in _groups(forwards, key_of):
        first = group[0]
        # the group runs where its first op was: every input of the others made before it
        group = [first] + [
            n
            for n in group[1:]
            if all(
                position.get(i, len(position)) < position[first]
                for i in n.all_input_nodes
                if i is not n.args[0]
            )
        ]
        if len(group) < 2:
            continue
        with graph.inserting_before(first):
            node = graph.call_function(
                torch.ops.fp4gen.linear_forward_group.default,
                (
                    first.args[0],
                    [n.args[1] for n in group],
                    [n.args[2] for n in group],
                    [n.args[3] for n in group],
                    first.args[4],
                ),
            )
            node.meta["val"] = [n.meta.get("val") for n in group]
            for i, member in enumerate(group):
                item = graph.call_function(operator.getitem, (node, i))
                item.meta["val"] = member.meta.get("val")
                member.replace_all_uses_with(item)
        for member in group:
            graph.erase_node(member)
        merged += len(group) - 1
    return merged


def _merge_backwards(graph: fx.Graph) -> int:
    """Merge each group of backward ops on one x; returns how many ops were merged away."""
    backwards = [
        n
        for n in graph.nodes
        if n.target is torch.ops.fp4gen.linear_backward.default and len(n.args) == 4
    ]
    merged = 0
    for group in _groups(backwards, lambda n: _value_key(n.args[1])):
        order = {n: i for i, n in enumerate(graph.nodes)}
        # the ops of the group run where its last one was; a later op whose inputs depend on
        # an earlier one's results cannot wait there: the group ends before it
        kept = [group[0]]
        after: set[fx.Node] = set()  # what depends on the kept ops' results, before the last
        for member in group[1:]:
            reach = set().union(*(_descendants(k, order, order[member]) for k in kept))
            if any(i in reach for i in member.all_input_nodes):
                break
            kept.append(member)
            after = reach
        if len(kept) < 2:
            continue
        last = kept[-1]
        # the nodes between the first and the last op that use an earlier op's results move
        # after the group (none of them feeds a later op: checked above)
        moving = sorted((n for n in after if n not in kept), key=order.__getitem__)
        with graph.inserting_before(last):
            node = graph.call_function(
                torch.ops.fp4gen.linear_backward_group.default,
                (
                    [n.args[0] for n in kept],
                    kept[0].args[1],
                    [n.args[2] for n in kept],
                    [n.args[3] for n in kept],
                ),
            )
        vals: list[Any] = []
        for n in kept:
            vals += list(n.meta.get("val") or (None, None))
        node.meta["val"] = vals
        for i, member in enumerate(kept):
            for user in list(member.users):
                # the op's (dx, dW) are read by getitem nodes: they read the group's now
                if user.target is not operator.getitem:
                    raise AssertionError(f"fp4gen::linear_backward read by {user.format_node()}")
                user.args = (node, 2 * i + user.args[1])
            graph.erase_node(member)
        anchor = node
        for n in moving:
            anchor.append(n)
            anchor = n
        merged += len(kept) - 1
    return merged


def _descendants(start: fx.Node, order: dict[fx.Node, int], before: int) -> set[fx.Node]:
    """``start`` and every node that depends on it, up to graph position ``before``."""
    seen: set[fx.Node] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node in seen or order.get(node, before) >= before:
            continue
        seen.add(node)
        stack.extend(node.users)
    return seen


class SharingPass(CustomGraphPass):
    """The pass inductor runs over each post-grad graph (module docstring). On a torch whose
    slot holds one pass only (no list), it wraps the passes the user had set there
    (``first``) and runs them before its own."""

    def __init__(self, first: tuple[Any, ...] = ()) -> None:
        self.first = first

    def __call__(self, graph: fx.Graph) -> None:
        for user_pass in self.first:
            user_pass(graph)
        fp4 = torch.ops.fp4gen  # registered by fp4gen.runtime.ops, whose ops install the pass
        ours = (fp4.linear_forward.default, fp4.linear_backward.default)
        if not any(n.target in ours for n in graph.nodes):
            return
        position = {n: i for i, n in enumerate(graph.nodes)}
        merged = _merge_forwards(graph, position) + _merge_backwards(graph)
        if merged:
            graph.lint()
            log.debug("fp4gen: %d compiled ops merged into groups that share x's copies", merged)

    def uuid(self) -> Any:
        # inductor's graph cache keys on it: this file's contents and the wrapped passes
        first = []
        for user_pass in self.first:
            uuid = getattr(user_pass, "uuid", None)
            first.append(uuid() if callable(uuid) else repr(user_pass))
        return (get_hash_for_files((__file__,)), tuple(first))


def install() -> None:
    """Put ``SharingPass`` in ``torch._inductor.config.post_grad_custom_pre_pass`` once, after
    the passes the user set there: appended to the list where torch takes a list of passes
    (``custom_graph_pass.get_custom_graph_passes``), else wrapping the one pass there. Called
    by the ops' fake kernels, which run while torch.compile traces a graph with fp4gen
    layers, before inductor compiles it."""
    import torch._inductor.config as inductor_config
    from torch._inductor import custom_graph_pass

    current = inductor_config.post_grad_custom_pre_pass
    if isinstance(current, list | tuple):
        passes = tuple(current)
    else:
        passes = () if current is None else (current,)
    if any(isinstance(p, SharingPass) for p in passes):
        return
    if hasattr(custom_graph_pass, "get_custom_graph_passes"):  # a list is taken
        inductor_config.post_grad_custom_pre_pass = [*passes, SharingPass()]
    else:
        inductor_config.post_grad_custom_pre_pass = SharingPass(passes)
