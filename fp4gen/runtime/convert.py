"""Whole-model conversion: replace torch.nn.Linear modules according to a recipe's layer rules.

Layers are the model's nn.Linear modules, and the GPT-2 style Conv1D modules of Hugging Face
transformers (a linear layer with a transposed weight, wrapped so that its parameter keeps its
layout), in ``named_modules()`` order. Blocks are the numbered children of the model's repeated
container (the nn.ModuleList or nn.Sequential whose numbered children hold the most linear
layers, e.g. ``transformer.h`` or ``model.layers``) that hold a linear layer; a block's index is
its rank among them, so in ``nn.Sequential(Linear, ReLU, Linear, ...)`` the activations are not
blocks. Rules apply in recipe order and the first that matches a layer decides it:

- ``first N blocks`` / ``last N blocks`` / ``first P% layers`` ...: by block or layer index; a
  percentage P of a count C covers round(P * C) units (halves round up);
- ``match "glob"``: fnmatch on the module's qualified name;
- the action keeps the layer in high precision (bf16/fp16/fp32: the module is left as it is),
  or quantizes all its operands with one format, or uses another recipe's operand table (and
  the MoR rules that recipe defines).

Layers no rule matches use the recipe's own operand table, except those outside the repeated
blocks (embeddings are not linear; output heads and the like): they stay as they are unless a
rule names them, as the NVFP4 paper keeps its head in high precision.

A Mixture-of-Experts layer's experts module (one module of 3-D weights, as transformers 5 holds
them: ``fp4gen.runtime.experts.experts_layout``) is one layer of its block here: rules match it
by name and index like a linear layer, and a converted one is a ``GroupedExperts`` running every
expert's GEMMs with its operand table (docs/moe.md).
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from fp4gen.dsl.model import (
    LayerRule,
    LayerSelector,
    MoRSpec,
    Operand,
    OperandTable,
    Recipe,
    RecipeRef,
)
from fp4gen.errors import ArgumentError, FP4GenError
from fp4gen.formats import BlockFormat, HighPrecision
from fp4gen.runtime.attention import MultiheadAttention, unsupported_reason
from fp4gen.runtime.cute_backend import padding_is_exact
from fp4gen.runtime.experts import GroupedExperts, all_gemms, experts_layout
from fp4gen.runtime.fsdp import enable_quantized_all_gather
from fp4gen.runtime.linear import Conv1DLinear, Linear, SharedGroup
from fp4gen.runtime.operands import k_multiple, round_up
from fp4gen.runtime.schedule import TrainingClock, action_mors, action_table

log = logging.getLogger("fp4gen.runtime")
_INDEX = re.compile(r"^\d+$")


def _is_conv1d(module: nn.Module) -> bool:
    """A Hugging Face transformers Conv1D (GPT-2's linear layer, weight [in, out]), found by its
    class so that transformers need not be imported."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.split(".", 1)[0] == "transformers"


def _is_linear(module: nn.Module) -> bool:
    """A linear layer convert() can replace: exactly torch.nn.Linear (subclasses may change what
    the layer computes) or a transformers Conv1D."""
    return type(module) is nn.Linear or _is_conv1d(module)


def _is_layer(module: nn.Module) -> bool:
    """A layer of the plan: a linear layer convert() can replace, or a grouped-experts module
    (``fp4gen.runtime.experts.experts_layout``), which a ``GroupedExperts`` replaces."""
    if _is_linear(module):
        return True
    return not isinstance(module, GroupedExperts) and _experts(module) is not None


def _experts(module: nn.Module) -> Any:
    """The module's ExpertsLayout, where it is a grouped-experts module convert can run."""
    layout = experts_layout(module)
    return None if layout is None or isinstance(layout, str) else layout


@dataclass(frozen=True)
class LayerDecision:
    """What convert() did with one nn.Linear, and why."""

    name: str
    layer_index: int
    block_index: int | None
    kept: bool  # left as a plain nn.Linear
    precision: str  # "bf16", a format name, or "recipe <name>"
    reason: str
    table: OperandTable | None = field(default=None, compare=False, repr=False)
    mors: tuple[MoRSpec, ...] = field(default=(), compare=False, repr=False)  # rules table names
    conv1d: bool = False  # a transformers Conv1D (weight [in, out]) rather than an nn.Linear
    experts: int = 0  # a grouped-experts module of this many experts (GroupedExperts)


def find_blocks(model: nn.Module) -> tuple[str | None, dict[str, int]]:
    """(container name, {linear module name: block index}) for the model's main stack of
    repeated blocks (the one holding the most linear layers; ``block_stacks`` gives every
    stack).

    A block's index is its rank among the container's numbered children that hold a linear
    layer (not its child position): activations, dropouts and norms between them are skipped,
    so ``first N blocks`` and ``last N blocks`` count blocks with something to convert."""
    stacks = block_stacks(model)
    return stacks[0] if stacks else (None, {})


def block_stacks(model: nn.Module) -> list[tuple[str, dict[str, int]]]:
    """Every stack of repeated blocks of the model, the main one first (``find_blocks``): then
    each further ``nn.ModuleList`` / ``nn.Sequential`` outside the stacks found so far, largest
    first, whose numbered children include two or more blocks (modules holding linear layers
    below them, not bare linear layers): an encoder-decoder's two stacks (T5, BART, Whisper,
    ``nn.Transformer``), a vision-language model's vision tower and language model. Block
    rules count blocks within each stack (``first 2 blocks``: the first two of every stack)."""
    linears = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) or _is_conv1d(m) or _is_layer(m)
    ]
    candidates: list[tuple[int, str, dict[str, int], bool]] = []
    for cname, container in model.named_modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        prefix = f"{cname}." if cname else ""
        owned: dict[str, int] = {}
        nested: set[int] = set()  # children holding their linear layers below them
        for lname in linears:
            if not lname.startswith(prefix):
                continue
            head, _, rest = lname[len(prefix) :].partition(".")
            if _INDEX.match(head):
                owned[lname] = int(head)
                if rest:
                    nested.add(int(head))
        children = sorted(set(owned.values()))
        if len(children) >= 2:
            rank = {child: i for i, child in enumerate(children)}
            ranks = {lname: rank[c] for lname, c in owned.items()}
            candidates.append((len(owned), cname, ranks, len(nested) >= 2))
    # the largest first; among equals the first in module order (the main stack as before)
    candidates.sort(key=lambda c: -c[0])
    stacks: list[tuple[str, dict[str, int]]] = []
    for _, cname, ranks, of_blocks in candidates:
        if stacks and not of_blocks:
            continue
        if any(_within(cname, taken) or _within(taken, cname) for taken, _ in stacks):
            continue
        stacks.append((cname, ranks))
    return stacks


def _within(name: str, container: str) -> bool:
    """Whether module ``name`` is ``container`` or lies below it."""
    return not container or name == container or name.startswith(f"{container}.")


def _count(sel: LayerSelector, total: int) -> int:
    if sel.fraction is not None:
        return int(sel.fraction * total + 0.5)
    return sel.count or 0


def _matches(
    sel: LayerSelector, name: str, layer: int, n_layers: int, block: int | None, n_blocks: int
) -> bool:
    if sel.kind == "match":
        return fnmatch.fnmatchcase(name, sel.pattern or "")
    if sel.unit == "blocks":
        if block is None:
            return False
        index, total = block, n_blocks
    else:
        index, total = layer, n_layers
    n = _count(sel, total)
    return index < n if sel.kind == "first" else index >= total - n


def _describe(rule: LayerRule) -> str:
    sel = rule.selector
    if sel.kind == "match":
        return f'rule match "{sel.pattern}"'
    amount = f"{sel.fraction * 100:g}%" if sel.fraction is not None else str(sel.count)
    return f"rule {sel.kind} {amount} {sel.unit}"


def plan_layers(model: nn.Module, recipe: Recipe) -> list[LayerDecision]:
    """Decide, for every nn.Linear (and grouped-experts module) of ``model``, what the recipe
    does with it (no changes)."""
    linears = [(n, m) for n, m in model.named_modules() if _is_layer(m)]
    block_of: dict[str, int] = {}
    n_blocks: dict[str, int] = {}  # linear layer name -> the block count of its stack
    for _, ranks in block_stacks(model):
        block_of.update(ranks)
        n_blocks.update(dict.fromkeys(ranks, len(set(ranks.values()))))
    decisions = []
    for index, (name, module) in enumerate(linears):
        block = block_of.get(name)
        decision = None
        for rule in recipe.layers:
            stack_blocks = n_blocks.get(name, 0)
            if _matches(rule.selector, name, index, len(linears), block, stack_blocks):
                action = rule.action
                if isinstance(action, HighPrecision):
                    decision = LayerDecision(name, index, block, True, action.name, _describe(rule))
                else:
                    label = (
                        f"recipe {action.recipe.name if action.recipe else action.path}"
                        if isinstance(action, RecipeRef)
                        else action.name
                    )
                    decision = LayerDecision(
                        name,
                        index,
                        block,
                        False,
                        label,
                        _describe(rule),
                        action_table(action),
                        action_mors(action),
                    )
                break
        if decision is None:
            if block_of and block is None:
                decision = LayerDecision(
                    name, index, block, True, "unchanged", "outside the repeated blocks"
                )
            else:
                decision = LayerDecision(
                    name,
                    index,
                    block,
                    False,
                    f"recipe {recipe.name}",
                    "default",
                    recipe.operands,
                    recipe.mors,
                )
        if _is_conv1d(module):
            decision = replace(decision, conv1d=True)
        elif not _is_linear(module):
            decision = replace(decision, experts=_experts(module).num_experts)
        decisions.append(decision)
    return decisions


# Parameters of at least this many elements that convert leaves in high precision are named in
# one warning and in show_plan (``convert(report_min_elements=...)``): a large tensor left
# behind is a large share of the model's memory and GEMM time outside the recipe.
REPORT_MIN_ELEMENTS = 1_000_000


@dataclass(frozen=True)
class KeptParameter:
    """A parameter ``convert`` left in high precision, and why."""

    name: str  # its qualified name, as in named_parameters() and the state_dict
    shape: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class ConversionReport:
    """What a conversion left in high precision and how much of the model it quantized, in
    parameter elements (a parameter tied to two modules counts once)."""

    kept: tuple[KeptParameter, ...]  # the large ones only: at least ``min_elements`` each
    min_elements: int
    parameters: int  # every parameter of the model
    quantized: int  # the weights of the converted layers: the GEMM operands the recipe quantizes
    layer_parameters: int  # the weights and biases of every linear layer (converted or not)

    @property
    def share(self) -> float:
        """The share of the model's parameters quantized."""
        return self.quantized / self.parameters if self.parameters else 0.0

    @property
    def layer_share(self) -> float:
        """The share of the linear layers' parameters quantized."""
        return self.quantized / self.layer_parameters if self.layer_parameters else 0.0

    def warning(self) -> str | None:
        """The one warning naming the kept parameters (None where there is none)."""
        if not self.kept:
            return None
        lines = [f"  {k.name} {list(k.shape)}: {k.reason}" for k in self.kept]
        return (
            f"fp4gen.convert left {len(self.kept)} parameters of {self.min_elements} elements "
            f"or more in high precision ({self.quantized} of {self.parameters} parameter "
            f"elements quantized, {self.share:.1%}):\n" + "\n".join(lines)
        )


def _owned_parameters(model: nn.Module) -> list[tuple[str, str, nn.Module, nn.Parameter]]:
    """(parameter name, owning module's name, module, parameter) for every parameter, each once
    (a tied parameter under its first name, as named_parameters() gives it)."""
    seen: set[int] = set()
    out = []
    for mname, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            out.append((f"{mname}.{pname}" if mname else pname, mname, module, param))
    return out


def _kept_reason(module: nn.Module, decision: LayerDecision | None) -> str:
    """Why a parameter of ``module`` stays in high precision."""
    if decision is not None:  # a layer the plan keeps
        if decision.precision == "unchanged":
            return f"{decision.reason} (kept as it is unless a layer rule names it)"
        return f"kept in {decision.precision} by the {decision.reason}"
    kind = type(module).__name__
    if isinstance(module, nn.Embedding):
        return f"an embedding ({kind}): convert quantizes linear layers only"
    if isinstance(module, nn.MultiheadAttention):
        why = unsupported_reason(module) or "the model itself (convert replaces submodules)"
        return f"a MultiheadAttention convert leaves as it is: {why}"
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return (
            "the output projection of a MultiheadAttention convert leaves as it is (its forward "
            "reads this weight itself)"
        )
    if isinstance(module, nn.Linear):
        return f"a subclass of nn.Linear ({kind}): convert replaces exactly torch.nn.Linear"
    layout = experts_layout(module)
    if isinstance(layout, str):
        return f"an unsupported experts module: {layout} (docs/moe.md)"
    if any(p.dim() == 3 for p in module.parameters(recurse=False)):
        return (
            f"an unsupported experts module ({kind}): its 3-D parameters are not a grouped-experts "
            "layout convert recognises (docs/moe.md)"
        )
    return f"a parameter of a {kind} module: not a linear layer"


def conversion_report(
    model: nn.Module, decisions: list[LayerDecision], min_elements: int = REPORT_MIN_ELEMENTS
) -> ConversionReport:
    """The parameters ``decisions`` leave in high precision (those of ``min_elements`` or more)
    and the shares quantized, for ``model`` before its layers are replaced."""
    by_name = {d.name: d for d in decisions}
    kept: list[KeptParameter] = []
    total = quantized = layer_total = 0
    for name, mname, module, param in _owned_parameters(model):
        n = param.numel()
        total += n
        decision = by_name.get(mname)
        if decision is not None:
            layer_total += n
            if not decision.kept and name in _quantized_names(mname, decision, module):
                quantized += n
                continue
        if n >= min_elements:
            kept.append(KeptParameter(name, tuple(param.shape), _kept_reason(module, decision)))
    return ConversionReport(tuple(kept), min_elements, total, quantized, layer_total)


def _quantized_names(mname: str, decision: LayerDecision, module: nn.Module) -> set[str]:
    """The parameters of a converted layer that are GEMM operands (a bias is added in fp32)."""
    prefix = f"{mname}." if mname else ""
    if decision.experts:
        return {f"{prefix}{name}" for name in _experts(module).weights}
    return {f"{prefix}weight"}


def convert(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    seed: int = 0,
    total_steps: int | None = None,
    backend: str = "auto",
    fsdp_quantized_all_gather: bool = False,
    amax_group: Any = None,
    amax_operands: Iterable[Operand | str] | None = None,
    report_min_elements: int = REPORT_MIN_ELEMENTS,
) -> nn.Module:
    """Replace the model's nn.Linear modules by fp4gen Linear layers per the recipe, in place
    (a transformers Conv1D by a ``Conv1DLinear``, which keeps its [in, out] weight).

    Returns the model. Each converted layer shares the original parameters (no copy), gets its
    own seed (``seed`` + its layer index) and a shared clock driven by ``set_step``. Converted
    layers take any token count and any feature size (padding, docs/numerics.md section 3).
    ``recipe``: a Recipe, a path or a shipped recipe's name.

    Converting a model once more with the same recipe and options changes nothing (a
    ``total_steps`` given is set, as ``set_step`` sets it); with another recipe or other options
    it raises FP4GenError and leaves the model as it is, as it does for a model holding layers a
    ``convert`` of one of its parts made: one model holds one conversion (its plan, which
    ``show_plan`` prints and ``fp4gen.export_quantized`` writes). Convert the original model
    again for another recipe.

    ``fsdp_quantized_all_gather``: under FSDP2, all-gather the converted layers' weights as
    codes and scales where that is exact, in high precision elsewhere
    (``fp4gen.runtime.fsdp.enable_quantized_all_gather``; call ``fully_shard`` afterwards).

    ``amax_group`` (a torch.distributed process group) and ``amax_operands``: sequence- or
    tensor-parallel inputs. Every converted layer quantizes those operands (default
    fprop.activation and dgrad.gradient) with the amax all-reduced over the group and rounds its
    activations and gradients with seed + rank * 2**20 (``Linear.set_amax_group``;
    docs/distributed.md). FP4GenError, before any layer is replaced, for an operand a layer
    cannot reduce exactly.

    Nothing large is left behind silently: every parameter of ``report_min_elements``
    (``REPORT_MIN_ELEMENTS``, 1M) elements or more that stays in high precision (a layer rule
    keeps its layer, it is outside the repeated blocks, an embedding, a module kind convert does
    not replace) is named with the reason in one WARNING of the ``fp4gen.runtime`` logger, with
    the share of the parameters quantized; ``show_plan`` lists them too
    (``ConversionReport``, ``report``).
    """
    if isinstance(recipe, str | os.PathLike):
        from fp4gen.dsl import load_recipe

        recipe = load_recipe(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}")
    if isinstance(report_min_elements, bool) or not isinstance(report_min_elements, int):
        raise ArgumentError(
            "report_min_elements must be an int (elements), got "
            f"{type(report_min_elements).__name__}"
        )
    if report_min_elements < 0:
        raise ArgumentError(f"report_min_elements must be >= 0, got {report_min_elements}")
    options = ConvertOptions(
        seed,
        backend,
        fsdp_quantized_all_gather,
        SharedGroup(amax_group),
        None if amax_operands is None else tuple(amax_operands),
    )
    if _already_converted(model, recipe, options):
        if total_steps is not None:  # the run's length, as set_step takes it
            _clock(model).total_steps = total_steps
        return model
    clock = TrainingClock(total_steps=total_steps)
    # attention modules with their projections as linear layers, before the plan sees them;
    # put back if the conversion is refused
    swapped = _swap_attention(model)
    try:
        decisions, report, layers = _plan_and_build(
            model, recipe, options, clock, report_min_elements
        )
    except BaseException:
        for name, original, _ in reversed(swapped):
            _set_module(model, name, original)
        raise
    # replaced only once every layer was accepted: a refusal leaves the model as it was
    for name, layer in layers:
        layer.converted_by = recipe.name  # a later convert of a model holding it refuses
        _set_module(model, name, layer)
    _warn_widths(layers)
    _close_fused_paths(model)
    if fsdp_quantized_all_gather:
        enable_quantized_all_gather(model)
    model._fp4gen_plan = decisions  # type: ignore[attr-defined]
    model._fp4gen_report = report  # type: ignore[attr-defined]
    warning = report.warning()
    if warning is not None:
        log.warning("%s", warning)
    model._fp4gen_clock = clock  # type: ignore[attr-defined]
    model._fp4gen_conversion = (recipe, options)  # type: ignore[attr-defined]
    return model


def _swap_attention(model: nn.Module) -> list[tuple[str, nn.Module, MultiheadAttention]]:
    """Every ``nn.MultiheadAttention`` submodule that ``MultiheadAttention.from_torch`` takes,
    replaced by it (the same parameters and computation, the projections as nn.Linear layers
    for the plan): (name, original, replacement) of each. The others stay, and the report
    says why (``_kept_reason``)."""
    found = [
        (name, module)
        for name, module in model.named_modules()
        if name and type(module) is nn.MultiheadAttention and unsupported_reason(module) is None
    ]
    swapped = []
    for name, module in found:
        new = MultiheadAttention.from_torch(module)
        _set_module(model, name, new)
        swapped.append((name, module, new))
    return swapped


def _plan_and_build(
    model: nn.Module,
    recipe: Recipe,
    options: ConvertOptions,
    clock: TrainingClock,
    report_min_elements: int,
) -> tuple[list[LayerDecision], ConversionReport, list[tuple[str, Linear | GroupedExperts]]]:
    """``convert``'s plan, report and new layers, the model not changed yet."""
    seed, backend = options.seed, options.backend
    amax_group, amax_operands = options.amax_group.group, options.amax_operands
    decisions = plan_layers(model, recipe)
    report = conversion_report(model, decisions, report_min_elements)
    schedule_mors = tuple(m for rule in recipe.schedule for m in action_mors(rule.action))
    schedule_mors += action_mors(recipe.evaluation)  # the eval statement's recipe may name some
    modules = dict(model.named_modules())
    _refuse_grouped_amax(decisions, options)
    layers: list[tuple[str, Linear | GroupedExperts]] = []
    for decision in decisions:
        if decision.kept:
            continue
        if decision.experts:
            layers.append(
                (decision.name, _grouped_experts(modules, decision, recipe, options, clock))
            )
            continue
        wrap = Conv1DLinear.from_conv1d if decision.conv1d else Linear.from_linear
        layer = wrap(
            modules[decision.name],
            operands=decision.table,
            seed=seed + decision.layer_index,
            name=decision.name,
            backend=backend,
            clock=clock,
            mors=decision.mors + schedule_mors,
        )
        layer.schedule.rules = recipe.schedule  # the schedule applies to every converted layer
        layer.schedule.evaluation = recipe.evaluation  # and so does the eval statement
        layer.check_supported()
        if amax_group is not None:  # checked against the schedule's tables too
            layer.set_amax_group(amax_group, amax_operands)
        layers.append((decision.name, layer))
    return decisions, report, layers


@dataclass(frozen=True)
class ConvertOptions:
    """The arguments of ``convert`` that shape its layers (besides the recipe): a second
    ``convert`` of a converted model is a no-op only where they are the same."""

    seed: int
    backend: str
    fsdp_quantized_all_gather: bool
    # a process group, held as the layers hold it (a deep copy of the model shares it) and
    # compared by identity
    amax_group: SharedGroup = field(compare=False)
    amax_operands: tuple[Operand | str, ...] | None

    def same_as(self, other: ConvertOptions) -> bool:
        return self == other and self.amax_group.group is other.amax_group.group

    def differences(self, earlier: ConvertOptions) -> tuple[str, str]:
        """('seed=0', 'seed=1'): the options that differ, as ``earlier`` and this hold them."""
        before, now = [], []
        for name in ("seed", "backend", "fsdp_quantized_all_gather", "amax_operands"):
            if getattr(earlier, name) != getattr(self, name):
                before.append(f"{name}={getattr(earlier, name)!r}")
                now.append(f"{name}={getattr(self, name)!r}")
        if self.amax_group.group is not earlier.amax_group.group:
            before.append("one amax_group")
            now.append("another amax_group")
        return ", ".join(before), ", ".join(now)


def _already_converted(model: nn.Module, recipe: Recipe, options: ConvertOptions) -> bool:
    """Whether ``model`` was converted before with this recipe and these options (then a
    second ``convert`` changes nothing). FP4GenError where it was converted with another recipe
    or options, or where it holds layers a ``convert`` of another module installed: converting
    again would mix two recipes' layers in one model and one plan, which ``show_plan`` and
    ``export_quantized`` would then misreport."""
    done: tuple[Recipe, ConvertOptions] | None = getattr(model, "_fp4gen_conversion", None)
    if done is not None:
        before, before_options = done
        if before == recipe and options.same_as(before_options):
            return True
        if before != recipe:
            was, wanted = f"recipe '{before.name}'", f"recipe '{recipe.name}'"
        else:
            was, wanted = options.differences(before_options)
            was = f"recipe '{before.name}' and {was}"
        raise FP4GenError(
            f"this model was already converted by fp4gen.convert with {was}; converting it "
            f"again with {wanted} would mix two conversions in one model: convert the "
            "original model (build or load it again) instead"
        )
    for name, module in model.named_modules():
        earlier = getattr(module, "converted_by", None)
        if isinstance(module, Linear | GroupedExperts) and earlier is not None:
            raise FP4GenError(
                f"{name or 'the model'} was already converted by fp4gen.convert (recipe "
                f"'{earlier}') as part of another module: convert the whole model once, "
                "with one recipe"
            )
    return False


@dataclass(frozen=True)
class WidthNote:
    """A feature size of converted layers that the generated quantize kernels do not take:
    ``features`` ("in_features" or "out_features") of ``size`` (after the RHT padding) is not a
    multiple of the block length of each of ``operands`` along it."""

    features: str
    size: int
    operands: tuple[str, ...]  # "fprop.activation (nvfp4 1x16)", ...
    multiple: int  # the least common multiple of their block lengths
    # every one of them the kernels zero-pad exactly (cute_backend.padding_is_exact): a copy
    # per call; else at least one runs on the torch reference
    padded: bool = False

    def message(self, layers: list[str]) -> str:
        more = f" (and {len(layers) - 1} more layers)" if len(layers) > 1 else ""
        head = (
            f"fp4gen.convert: {self.features} {self.size} of {layers[0]}{more} is not a "
            f"multiple of the blocks of {' and '.join(self.operands)}: on CUDA "
        )
        if self.padded:
            return head + (
                "the generated quantize kernels zero-pad those operands to their multiple on "
                "every call (exact; a copy of the tensor, docs/quantize-kernels.md); a multiple "
                f"of {self.multiple} avoids the copy"
            )
        return head + (
            "the generated quantize kernels cannot zero-pad all of them exactly (stochastic "
            "rounding or scales, MS-EDEN, block targets on a narrow tile), so those are "
            "quantized by the torch reference (the same bits, several times slower); a multiple "
            f"of {self.multiple} avoids it (docs/numerics.md, section 3)"
        )


def width_notes(layer: Linear) -> list[WidthNote]:
    """The feature sizes of ``layer`` that leave a block-format operand of any operand table its
    precision schedule can switch to without a quantize kernel (``WidthNote``). A GEMM's K is
    padded to its operands' RHT sizes only (docs/numerics.md, section 3), so a K that is not a
    multiple of a block length is quantized with an edge block, which the kernels do not
    generate; the token count is padded to the blocks and never appears here."""
    tables = layer.schedule.tables()
    notes: dict[WidthNote, None] = {}
    for table in tables:
        gemms = (  # the GEMMs whose K is a feature size: fprop (in) and dgrad (out)
            ("in_features", layer.in_features, Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT),
            ("out_features", layer.out_features, Operand.DGRAD_GRADIENT, Operand.DGRAD_WEIGHT),
        )
        for features, size, a, b in gemms:
            padded = round_up(size, k_multiple(table[a], table[b], blocks=False))
            short, lengths, exact = [], [], True
            for op in (a, b):
                fmt = table[op].format
                if isinstance(fmt, BlockFormat) and padded % fmt.block_len:
                    short.append(f"{op.selector} ({fmt.name} {fmt.block[0]}x{fmt.block[1]})")
                    lengths.append(fmt.block_len)
                    exact = exact and padding_is_exact(fmt, table[op].rounding, padded)
            if short:
                note = WidthNote(features, padded, tuple(short), math.lcm(*lengths), exact)
                notes[note] = None
    return list(notes)


def _refuse_grouped_amax(decisions: list[LayerDecision], options: ConvertOptions) -> None:
    """FP4GenError, before any layer is made, for an amax_group with an experts module to
    convert: each rank routes its own tokens, so the ranks would not call an expert's GEMMs (and
    their all-reduces) together."""
    if options.amax_group.group is None:
        return
    for decision in decisions:
        if decision.experts and not decision.kept:
            raise FP4GenError(
                f"{decision.name}: amax_group is not supported for experts modules (each rank "
                "routes its own tokens, so the ranks would not call an expert's GEMMs "
                "together); keep it in high precision with a layer rule, or convert without "
                "amax_group"
            )


def _grouped_experts(
    modules: dict[str, nn.Module],
    decision: LayerDecision,
    recipe: Recipe,
    options: ConvertOptions,
    clock: TrainingClock,
) -> GroupedExperts:
    """The GroupedExperts that replaces the experts module ``decision`` names."""
    source = modules[decision.name]
    assert decision.table is not None
    experts = GroupedExperts(
        source,
        _experts(source),
        operands=decision.table,
        seed=options.seed + decision.layer_index,
        name=decision.name,
        backend=options.backend,
        clock=clock,
        mors=decision.mors
        + tuple(m for r in recipe.schedule for m in action_mors(r.action))
        + action_mors(recipe.evaluation),
        recipe=recipe,
    )
    experts.check_supported()
    return experts


def _warn_widths(layers: list[tuple[str, Linear | GroupedExperts]]) -> None:
    """One line per feature size the kernels do not take, naming the layers (``WidthNote``):
    a WARNING where an operand goes to the torch reference, INFO where the kernels pad."""
    named: dict[WidthNote, list[str]] = {}
    for name, module in layers:
        # an experts module's GEMMs: every expert's have the sizes of the first one's
        gemms = module.gemms[0] if isinstance(module, GroupedExperts) else (module,)
        for note in (n for layer in gemms for n in width_notes(layer)):
            named.setdefault(note, []).append(name)
    for note, names in named.items():
        log.log(logging.INFO if note.padded else logging.WARNING, "%s", note.message(names))


def _close_fused_paths(model: nn.Module) -> None:
    """Turn off torch's fused inference paths that would bypass converted layers.

    ``nn.TransformerEncoderLayer`` in eval mode without grad runs one fused kernel
    (``torch._transformer_encoder_layer_fwd``) that reads ``linear1.weight`` and
    ``linear2.weight`` itself, so its converted feed-forward layers would silently run in high
    precision there. ``nn.TransformerEncoder`` turns padded batches into nested tensors for
    that path. Each path is closed by the flag torch checks before taking it
    (``activation_relu_or_gelu``, which only that path reads; ``use_nested_tensor``), so the
    layers' own forwards run, with the same math as in training; also in every layer whose
    attention convert made an ``attention.MultiheadAttention`` (the path reads
    ``in_proj_weight`` and ``out_proj.weight`` itself). Logged once per model."""
    closed = []
    for name, module in model.named_modules():
        fused = isinstance(module, nn.TransformerEncoderLayer) and module.activation_relu_or_gelu
        if not fused:
            continue
        # fp4gen's attention, converted or kept: the path would bypass its forward
        ours = isinstance(module.self_attn, MultiheadAttention)
        if ours or any(isinstance(m, Linear) for m in (module.linear1, module.linear2)):
            module.activation_relu_or_gelu = 0
            closed.append(name or type(module).__name__)
    for module in model.modules():
        nested = isinstance(module, nn.TransformerEncoder) and getattr(
            module, "use_nested_tensor", False
        )
        if nested and any(not layer.activation_relu_or_gelu for layer in module.layers):
            module.use_nested_tensor = False
    if closed:
        log.info(
            "fp4gen.convert: torch's fused inference path of nn.TransformerEncoderLayer reads "
            "the feed-forward and attention weights itself; turned off for %s so the converted "
            "layers run in eval mode too",
            ", ".join(closed),
        )


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _clock(model: nn.Module) -> TrainingClock:
    clock = getattr(model, "_fp4gen_clock", None)
    if clock is None:
        raise FP4GenError("this model was not converted with fp4gen.convert")
    return clock


def _clocks(model: nn.Module) -> list[TrainingClock]:
    """The clocks ``set_step`` drives: a converted model's, and those of the fp4gen Linears
    ``model`` is or holds (a layer built with fp4gen.nn.Linear has its own)."""
    clocks: dict[int, TrainingClock] = {}
    converted = getattr(model, "_fp4gen_clock", None)
    if converted is not None:
        clocks[id(converted)] = converted
    for module in model.modules():
        if isinstance(module, Linear):
            clock = module.schedule.clock
            clocks.setdefault(id(clock), clock)
    if not clocks:
        raise FP4GenError(
            f"set_step: this {type(model).__name__} holds no fp4gen layer (convert it with "
            "fp4gen.convert, or build it with fp4gen.nn.Linear)"
        )
    return list(clocks.values())


def set_step(model: nn.Module, step: int, total_steps: int | None = None) -> None:
    """Tell a model which optimizer step it is at (drives the precision schedule): a model
    converted with ``convert``, an ``fp4gen.nn.Linear`` or any module holding such layers.
    ``total_steps``: the run's length, for a schedule that switches at a fraction of it."""
    for clock in _clocks(model):
        clock.step = step
        if total_steps is not None:
            clock.total_steps = total_steps


def layer_decisions(model: nn.Module) -> list[LayerDecision]:
    """What ``convert`` decided for each linear layer of ``model``, in layer order
    (``fp4gen.show_plan`` prints them as a table)."""
    decisions: list[LayerDecision] | None = getattr(model, "_fp4gen_plan", None)
    if decisions is None:
        raise FP4GenError("this model was not converted with fp4gen.convert")
    return decisions


def report(model: nn.Module) -> ConversionReport:
    """What ``convert`` left in high precision in ``model`` and the shares it quantized
    (``fp4gen.show_plan`` prints it under the layers)."""
    found: ConversionReport | None = getattr(model, "_fp4gen_report", None)
    if found is None:
        raise FP4GenError("this model was not converted with fp4gen.convert")
    return found


def enable_telemetry(model: nn.Module, every: int) -> None:
    """Record each converted layer's quantization error every ``every`` calls (0 turns it off)."""
    for module in [*model.modules(), *all_gemms(model)]:
        if isinstance(module, Linear):
            module.telemetry.every = every


def telemetry(model: nn.Module) -> list[dict]:
    """All telemetry records of the model's converted layers, oldest first per layer."""
    out: list[dict] = []
    for module in [*model.modules(), *all_gemms(model)]:
        if isinstance(module, Linear):
            out.extend(module.telemetry.records)
    return out


def count_converted(model: nn.Module) -> int:
    """The converted layers of ``model``: its fp4gen Linears and GroupedExperts modules."""
    return sum(isinstance(m, Linear | GroupedExperts) for m in model.modules())


__all__ = [
    "REPORT_MIN_ELEMENTS",
    "ConversionReport",
    "KeptParameter",
    "LayerDecision",
    "convert",
    "count_converted",
    "enable_telemetry",
    "block_stacks",
    "find_blocks",
    "layer_decisions",
    "plan_layers",
    "report",
    "set_step",
    "telemetry",
]
