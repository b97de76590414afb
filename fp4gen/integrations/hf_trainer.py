"""Train with a recipe under Hugging Face transformers' ``Trainer``: ``FP4GenCallback``.

The callback converts the model when training begins (``on_train_begin``, with the Trainer's
``max_steps`` as the run's length, so a schedule at a fraction of training switches where the
recipe says), tells the converted layers the optimizer step before each step
(``fp4gen.set_step``), and optionally records per-layer quantization telemetry on every N-th
step, written to the output folder when training ends.

When it converts: ``Trainer.train`` (transformers 5) creates the optimizer and prepares the
model (DDP, ``torch.compile``) before ``on_train_begin``. ``fp4gen.convert`` keeps the model's
Parameter objects (each converted layer shares its ``nn.Linear``'s weight and bias), so the
optimizer and DDP's hooks already hold the parameters the converted layers train, and a compiled
model traces the converted modules on its first call. FSDP and DeepSpeed shard the parameters
while the model is prepared, before the callback runs: there, convert the model before building
the Trainer (docs/distributed.md: convert first, then shard) and give the callback the same
recipe, seed and backend; its ``convert`` of the converted model then only sets the run's length.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp4gen.dsl.model import Recipe
from fp4gen.errors import ArgumentError, FP4GenError
from fp4gen.outputs import PLAIN_NAME_RULE, OutputFiles, is_plain_name
from fp4gen.runtime.convert import convert, count_converted, enable_telemetry, set_step
from fp4gen.runtime.experts import all_gemms
from fp4gen.runtime.linear import Linear

try:
    from transformers import TrainerCallback
except ImportError as err:  # the optional extra
    raise ImportError(
        "fp4gen.integrations.hf_trainer needs transformers: pip install -e '.[hf]'"
    ) from err

log = logging.getLogger("fp4gen.integrations")

TELEMETRY_FILE = "fp4gen_telemetry.json"  # in the Trainer's output_dir


class FP4GenCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that trains the Trainer's model with ``recipe``.

    ``recipe``: a Recipe, a ``.fp4r`` path or a shipped name (loaded here, so a bad recipe fails
    before training starts). ``seed`` and ``backend`` are ``fp4gen.convert``'s.
    ``telemetry_every`` = N > 0 records every converted layer's quantization error on the
    optimizer steps whose index is a multiple of N (all their micro-batches), each record tagged
    with its ``step`` and the recipe's name; the records are written as ``{"records": [...]}``
    to ``output_dir/telemetry_file`` when training ends (by the main process), which
    ``fp4gen report`` reads.
    """

    def __init__(
        self,
        recipe: Recipe | str | os.PathLike[str],
        *,
        seed: int = 0,
        backend: str = "auto",
        telemetry_every: int = 0,
        telemetry_file: str = TELEMETRY_FILE,
    ) -> None:
        if isinstance(recipe, str | os.PathLike):
            from fp4gen.dsl import load_recipe

            recipe = load_recipe(recipe)
        if not isinstance(recipe, Recipe):
            raise ArgumentError(
                f"recipe must be a Recipe, a .fp4r path or a shipped name, got "
                f"{type(recipe).__name__}"
            )
        if isinstance(telemetry_every, bool) or not isinstance(telemetry_every, int):
            raise ArgumentError(
                f"telemetry_every must be an int (steps), got {type(telemetry_every).__name__}"
            )
        if telemetry_every < 0:
            raise ArgumentError(f"telemetry_every must be >= 0 (0: off), got {telemetry_every}")
        if not isinstance(telemetry_file, str) or not is_plain_name(telemetry_file):
            raise ArgumentError(f"telemetry_file must be {PLAIN_NAME_RULE}, got {telemetry_file!r}")
        self.recipe = recipe
        self.seed = seed
        self.backend = backend
        self.telemetry_every = telemetry_every
        self.telemetry_file = telemetry_file
        self.model: nn.Module | None = None  # the model converted at train start
        self.step: int | None = None  # the last step given to set_step
        self.telemetry_path: Path | None = None  # where on_train_end wrote the records
        self._recording = False
        self._tagged: dict[int, int] = {}  # layer id -> its records tagged with a step so far

    # -- Trainer events --------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise FP4GenError(
                "FP4GenCallback: the Trainer gave on_train_begin no model "
                f"(got {type(model).__name__})"
            )
        if getattr(model, "_fp4gen_conversion", None) is None:
            sharded = _sharding(args, model)
            if sharded is not None:
                raise FP4GenError(
                    f"FP4GenCallback: the Trainer prepared the model for {sharded}, which shards "
                    "its parameters before on_train_begin; convert the model with "
                    "fp4gen.convert before building the Trainer (and give the callback the same "
                    "recipe, seed and backend)"
                )
        # the same Parameter objects stay in the model, so the optimizer made before this
        # event trains the converted layers (module docstring)
        convert(
            model, self.recipe, seed=self.seed, total_steps=state.max_steps, backend=self.backend
        )
        self.model = model
        self._tagged = {}
        self._set_step(model, state.global_step)  # a resumed run starts past 0
        log.info(
            "fp4gen: %d layers converted with recipe %s for %d steps",
            count_converted(model),
            self.recipe.name,
            state.max_steps,
        )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self._model(kwargs.get("model"))
        self._set_step(model, state.global_step)
        every = self.telemetry_every
        if every and state.global_step % every == 0:
            enable_telemetry(model, 1)  # every call of this step: each micro-batch
            self._recording = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._recording:
            return
        model = self._model(kwargs.get("model"))
        enable_telemetry(model, 0)  # evaluation and the other steps record nothing
        self._recording = False
        # global_step counts this step already: the records are of the step before it
        self._tag(model, state.global_step - 1)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.telemetry_every or self.model is None:
            return
        if self._recording:  # training stopped inside a recorded step
            enable_telemetry(self.model, 0)
            self._recording = False
        if not state.is_world_process_zero:
            return
        files = OutputFiles(args.output_dir, flag="output_dir")
        text = json.dumps({"records": self.records()})
        self.telemetry_path = files.write_text(self.telemetry_file, text)

    # -- helpers -----------------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """The telemetry records of the converted model so far, oldest first per layer, each
        with its ``step`` and ``recipe``."""
        if self.model is None:
            return []
        return [record for layer in _layers(self.model) for record in layer.telemetry.records]

    def _model(self, given: Any) -> nn.Module:
        model = self.model if self.model is not None else given
        if not isinstance(model, nn.Module):
            raise FP4GenError(
                "FP4GenCallback: a training step began before on_train_begin converted the model"
            )
        return model

    def _set_step(self, model: nn.Module, step: int) -> None:
        set_step(model, step)
        self.step = step

    def _tag(self, model: nn.Module, step: int) -> None:
        """Give the records each layer appended since the last tagging the step and recipe."""
        for layer in _layers(model):
            records = layer.telemetry.records
            for record in records[self._tagged.get(id(layer), 0) :]:
                record["step"] = step
                record["recipe"] = self.recipe.name
            self._tagged[id(layer)] = len(records)


def _layers(model: nn.Module) -> list[Linear]:
    """The fp4gen Linears of ``model``, the per-expert ones of its experts modules included,
    each once."""
    found = {id(m): m for m in [*model.modules(), *all_gemms(model)] if isinstance(m, Linear)}
    return list(found.values())


def _sharding(args: Any, model: nn.Module) -> str | None:
    """'FSDP' or 'DeepSpeed' where the Trainer shards the model's parameters, else None."""
    if getattr(args, "deepspeed", None):
        return "DeepSpeed"
    if getattr(args, "fsdp", None):
        return "FSDP"
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        if isinstance(module, FSDPModule | FullyShardedDataParallel):
            return "FSDP"
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            return "FSDP"
    return None


__all__ = ["TELEMETRY_FILE", "FP4GenCallback"]
