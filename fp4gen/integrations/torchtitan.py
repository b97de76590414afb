"""Train torchtitan models with a recipe: fp4gen as a torchtitan (0.3) model converter.

torchtitan 0.3 converts a model by rewriting its config tree before the model is built
(``torchtitan.protocols.model.ModelConfigConverter``: ``convert(model_config)``), then builds it
on the meta device, parallelizes it (tensor parallelism, activation checkpointing, per-block
``torch.compile``, FSDP2) and only then materializes and initializes the weights.
``FP4GenConverter`` is such a converter (a ``QuantizationConverter``, so torchtitan orders it
before LoRA): it replaces each ``Linear.Config`` the recipe converts by an ``FP4GenLinear.Config``,
so the built model holds ``FP4GenLinear`` modules, which are ``fp4gen.nn.Linear`` layers and
torchtitan ``Module``\\ s at once (parameter init, the Module protocol, FSDP2 and compile as
torchtitan applies them to the stock ``Linear``).

Which layers it converts, and with what, is ``fp4gen.convert``'s decision
(``fp4gen.runtime.convert.plan_layers``, the recipe's layer rules) taken on the config tree:
layers are the config's ``Linear.Config`` entries (exactly that class: a subclass may compute
something else and is kept, as ``convert`` keeps nn.Linear subclasses), named by their module
names (``layers.3.feed_forward.w2``) and numbered in the config's order; blocks are the numbered
entries of the repeated ``layers`` list. The job config may replace the recipe's layer rules
(``FP4GenConverter.Config.layers``: rule lines in recipe syntax, as a recipe's own ``layers``
section replaces its parent's).

The precision schedule follows the optimizer: ``step_hook`` (a torchtitan
``post_optimizer_build_fn``) registers an optimizer step post-hook that calls
``fp4gen.set_step`` on every model part after each optimizer step, so every micro-batch of a
step runs with the same operand table; at the first forward it reads the step a resumed run
starts from out of the optimizer's state. ``fp4gen.integrations.torchtitan_trainer.FP4GenTrainer``
wires both from one config section (``--fp4gen.recipe`` on torchtitan's command line).

Tensor parallelism is not supported (a converted layer quantizes whole weights): a converted
model with a tensor-parallel degree above 1 raises ``FP4GenError`` when it is parallelized.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp4gen.dsl.model import Recipe
from fp4gen.errors import ArgumentError, FP4GenError, RecipeError
from fp4gen.runtime.convert import LayerDecision, plan_layers, set_step
from fp4gen.runtime.linear import Linear
from fp4gen.runtime.schedule import TrainingClock, action_mors

try:
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.models.common.linear import Linear as TitanLinear
    from torchtitan.protocols.module import Module as TitanModule
except ImportError as err:  # the optional extra
    raise ImportError(
        "fp4gen.integrations.torchtitan needs torchtitan 0.3: pip install -e '.[torchtitan]'"
    ) from err

log = logging.getLogger("fp4gen.integrations")


@dataclass(frozen=True, eq=False)  # compared by identity: the clock is shared and mutable
class LayerPlan:
    """What one converted layer is built with: ``convert``'s decision for it, the recipe (its
    schedule and eval statement apply to every converted layer), the run's seed and backend,
    and the clock ``set_step`` drives (one per conversion, shared by its layers)."""

    decision: LayerDecision
    recipe: Recipe
    seed: int
    backend: str
    clock: TrainingClock


class FP4GenLinear(Linear, TitanModule):
    """An ``fp4gen.nn.Linear`` that is a torchtitan ``Module``: built from a config (on the meta
    device, its weights initialized later by torchtitan's ``param_init``), parallelized and
    compiled as torchtitan's ``Linear``. Same parameters and state_dict as that ``Linear``, so
    checkpoints move between converted and unconverted runs."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanLinear.Config):
        """``Linear.Config`` plus the layer's plan (a private field: torchtitan's ``to_dict``
        leaves out names starting with ``_``, so the job's printed config stays plain)."""

        _fp4gen: LayerPlan | None = None

    def __init__(self, config: Config) -> None:
        plan = config._fp4gen
        if plan is None:
            raise FP4GenError(
                "FP4GenLinear.Config needs its layer plan: build it with FP4GenConverter"
            )
        decision, recipe = plan.decision, plan.recipe
        schedule_mors = tuple(m for rule in recipe.schedule for m in action_mors(rule.action))
        schedule_mors += action_mors(recipe.evaluation)
        Linear.__init__(
            self,
            config.in_features,
            config.out_features,
            bias=config.bias,
            operands=decision.table,
            seed=plan.seed + decision.layer_index,
            name=decision.name,
            backend=plan.backend,
            clock=plan.clock,
            mors=decision.mors + schedule_mors,
        )
        self.schedule.rules = recipe.schedule  # as fp4gen.convert sets them on its layers
        self.schedule.evaluation = recipe.evaluation
        self.check_supported()
        self.converted_by = recipe.name

    def parallelize(self, parallel_dims: Any) -> None:
        if getattr(parallel_dims, "tp", 1) > 1:
            raise FP4GenError(
                f"{self.name}: fp4gen layers do not support tensor parallelism (degree "
                f"{parallel_dims.tp}): a converted layer quantizes whole weights and "
                "activations; use data parallelism (FSDP2) or keep the layer out of the recipe"
            )
        TitanModule.parallelize(self, parallel_dims)


def layer_rules(recipe: Recipe, rules: list[str]) -> Recipe:
    """``recipe`` with its layer rules replaced by ``rules`` (rule lines in recipe syntax, e.g.
    ``last 1 blocks : bf16``), as a recipe that extends it with its own ``layers`` section
    would have them. An empty list keeps the recipe's rules. A bad rule raises
    ``RecipeError`` naming its index in the list."""
    if not rules:
        return recipe
    if recipe.source is None:
        raise ArgumentError(
            f"layer rules from the job config need the recipe {recipe.name!r} as a file "
            "(a path or a shipped name) to extend"
        )
    # each rule on its own first: an error names the rule, not a line of generated text
    for index, rule in enumerate(rules):
        _rules_recipe(recipe, [rule], f"layers[{index}] {rule!r}")
    return replace(recipe, layers=_rules_recipe(recipe, rules, "layers").layers)


def _rules_recipe(recipe: Recipe, rules: list[str], what: str) -> Recipe:
    from fp4gen.dsl import parse_recipe

    source = Path(recipe.source or ".")
    body = "".join(f"    {rule.strip()}\n" for rule in rules)
    text = f'recipe {recipe.name}\nextends "{source.name}"\n\nlayers {{\n{body}}}\n'
    try:
        return parse_recipe(text, base_dir=source.parent)
    except RecipeError as err:
        raise RecipeError(f"the fp4gen converter's {what}: {err}") from None


def _shadow_model(entries: list[tuple[str, TitanLinear.Config]]) -> nn.Module:
    """An nn.Module tree with one meta-device nn.Linear at each of ``entries``' module names,
    numbered containers as nn.Sequential: what ``plan_layers`` reads (layer names, order and
    the repeated blocks) without building the model."""
    root = nn.Module()
    for fqn, config in entries:
        *path, leaf = fqn.split(".")
        node = root
        for depth, part in enumerate(path):
            child = node._modules.get(part)
            if child is None:
                below = path[depth + 1] if depth + 1 < len(path) else leaf
                child = nn.Sequential() if below.isdigit() else nn.Module()
                node.add_module(part, child)
            node = child
        linear = nn.Linear(config.in_features, config.out_features, config.bias, device="meta")
        node.add_module(leaf, linear)
    return root


class FP4GenConverter(QuantizationConverter):
    """A torchtitan model converter that trains the model's linear layers with a recipe."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "nvfp4_small"
        """A ``.fp4r`` path or a shipped recipe's name."""

        layers: list[str] = field(default_factory=list)
        """Layer rules replacing the recipe's (recipe syntax, one rule each:
        ``"last 1 blocks : bf16"``, ``'match "lm_head" : bf16'``); empty keeps the recipe's."""

        seed: int = 0
        """Stochastic rounding seed: each converted layer uses seed + its layer index."""

        backend: str = "auto"
        """fp4gen's kernel backend (``auto``, ``reference``, ``cute``)."""

    def __init__(self, config: Config) -> None:
        from fp4gen.dsl import load_recipe

        self.config = config
        self.recipe = layer_rules(load_recipe(config.recipe), list(config.layers))
        self.clock = TrainingClock()
        self.decisions: list[LayerDecision] = []

    def convert(self, model_config: Any) -> Any:
        """Replace the ``Linear.Config`` entries the recipe converts (in place; returns the
        root config, as the protocol asks)."""
        found = list(model_config.traverse(TitanLinear.Config))
        exact = [(fqn, cfg) for fqn, cfg, _, _ in found if type(cfg) is TitanLinear.Config]
        self.decisions = plan_layers(_shadow_model(exact), self.recipe)
        by_name = {d.name: d for d in self.decisions}
        converted = 0
        for fqn, config, parent, attr in found:
            decision = by_name.get(fqn)
            if decision is None or decision.kept:
                continue
            plan = LayerPlan(
                decision, self.recipe, self.config.seed, self.config.backend, self.clock
            )
            new = FP4GenLinear.Config(
                in_features=config.in_features,
                out_features=config.out_features,
                bias=config.bias,
                param_init=config.param_init,
                sharding_config=config.sharding_config,
                _fp4gen=plan,
            )
            converted += 1
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        kept = [d for d in self.decisions if d.kept]
        others = len(found) - len(exact)
        log.info(
            "fp4gen: %d linear layer(s) converted with recipe %s, %d kept (%s)%s",
            converted,
            self.recipe.name,
            len(kept),
            ", ".join(f"{d.name}: {d.reason}" for d in kept) or "none",
            f", {others} Linear subclass(es) left as they are" if others else "",
        )
        return model_config


class StepHook:
    """Drives the precision schedule of torchtitan's model parts from its optimizer: the step
    ``set_step`` is given is the number of optimizer steps taken (0 before the first).

    ``register`` is a torchtitan ``post_optimizer_build_fn`` (``ModelSpec``): it sets step 0
    (and the run's length), hooks every optimizer step, and hooks the first forward of the
    first model part, which reads the step a resumed run starts from (torchtitan loads the
    checkpoint after the optimizer is built) from the optimizer's state."""

    def __init__(self, total_steps: int | None = None) -> None:
        self.total_steps = total_steps
        self.step = 0
        self.model_parts: list[nn.Module] = []
        self._first_forward: Any = None

    def register(self, optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any) -> None:
        self.model_parts = list(model_parts)
        self._set(0)
        optimizers.register_step_post_hook(self._after_step)

        def first_forward(module: nn.Module, args: Any) -> None:
            self._first_forward.remove()
            taken = optimizer_steps(optimizers)
            if taken:  # a resumed run
                self._set(taken)

        self._first_forward = self.model_parts[0].register_forward_pre_hook(first_forward)

    def _after_step(self, *args: Any, **kwargs: Any) -> None:
        self._set(self.step + 1)

    def _set(self, step: int) -> None:
        self.step = step
        for part in self.model_parts:
            set_step(part, step, self.total_steps)


def optimizer_steps(optimizers: Any) -> int:
    """The optimizer steps a torchtitan ``OptimizersContainer`` (or a torch optimizer) has
    taken, read from the first parameter state holding a ``step`` (Adam, AdamW and most torch
    optimizers keep one; 0 where none does). A step held on the GPU is read once."""
    inner = getattr(optimizers, "optimizers", [optimizers])
    for optimizer in inner:
        for state in optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is not None:
                return int(step.item() if isinstance(step, torch.Tensor) else step)
    return 0


def step_hook(
    total_steps: int | None = None,
    then: Callable[..., None] | None = None,
) -> Callable[..., None]:
    """A ``post_optimizer_build_fn`` that registers a ``StepHook`` (``total_steps``: the run's
    length, for a schedule at a fraction of training), after ``then`` (a model's own, e.g.
    MoE load balancing) where given."""
    hook = StepHook(total_steps)

    def post_optimizer_build(optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any):
        if then is not None:
            then(optimizers, model_parts, parallel_dims)
        hook.register(optimizers, model_parts, parallel_dims)

    post_optimizer_build.hook = hook  # type: ignore[attr-defined]
    return post_optimizer_build


def apply_to_model_spec(
    model_spec: Any, converter: FP4GenConverter.Config, total_steps: int | None
) -> FP4GenConverter:
    """Convert ``model_spec``'s model config with ``converter`` and chain the step hook into
    its ``post_optimizer_build_fn``, in place; returns the converter (its ``decisions``)."""
    built = converter.build()
    model_spec.model = built.convert(model_spec.model)
    model_spec.post_optimizer_build_fn = step_hook(total_steps, model_spec.post_optimizer_build_fn)
    return built


__all__ = [
    "FP4GenConverter",
    "FP4GenLinear",
    "LayerPlan",
    "StepHook",
    "apply_to_model_spec",
    "layer_rules",
    "optimizer_steps",
    "step_hook",
]
