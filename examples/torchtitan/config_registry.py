"""torchtitan job configs that train with an fp4gen recipe (torchtitan 0.3's config registry).

torchtitan 0.3 takes its job config from a Python function (``--module`` names the module,
``--config`` the function) and overrides its fields on the command line. Two ways in:

- ``llama3_debugmodel_fp4gen``: ``FP4GenTrainer``'s config, torchtitan's Llama 3 debug job
  with an ``fp4gen`` section, so the recipe and its layer rules come from the command line
  (``--fp4gen.recipe``, ``--fp4gen.layers``, ``--fp4gen.seed``, ``--fp4gen.backend``);
- ``llama3_debugmodel_fp4gen_converter``: torchtitan's own Trainer, with ``FP4GenConverter`` in
  the model registry's converter list and the step hook as the model's
  ``post_optimizer_build_fn`` (the recipe fixed in this file).

Both checkpoint activations as torchtitan's debug job does; ``--compile.enable`` compiles each
block. Run from a torchtitan checkout (its debug job reads ``tests/assets``: the tokenizer and
the c4_test data) with fp4gen installed (``pip install -e "/path/to/fp4gen[torchtitan]"``) and
the fp4gen checkout on PYTHONPATH, so that ``examples.torchtitan`` names this folder:

    cd /path/to/torchtitan
    PYTHONPATH=/path/to/fp4gen torchrun --nproc_per_node=1 -m torchtitan.train \\
        --module examples.torchtitan --config llama3_debugmodel_fp4gen \\
        --fp4gen.recipe nvfp4_small --fp4gen.layers "last 1 blocks : bf16" \\
        --compile.enable --training.steps 20

The converter config's step hook takes the run's length from this file's ``training.steps``;
``FP4GenTrainer`` takes it from the job's (a ``--training.steps`` given on the command line).
"""

from __future__ import annotations

from dataclasses import fields

from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from fp4gen.integrations.torchtitan import FP4GenConverter, step_hook
from fp4gen.integrations.torchtitan_trainer import FP4GenTrainer


def llama3_debugmodel_fp4gen() -> FP4GenTrainer.Config:
    """torchtitan's Llama 3 debug job with an ``fp4gen`` section (nvfp4_small by default)."""
    base = llama3_debugmodel()
    config = FP4GenTrainer.Config(**{f.name: getattr(base, f.name) for f in fields(base)})
    config.fp4gen = FP4GenConverter.Config(recipe="nvfp4_small")
    config.compile.components = ["model", "loss"]
    return config


def llama3_debugmodel_fp4gen_converter():
    """torchtitan's Trainer and debug job, the model converted by ``FP4GenConverter`` in the
    model registry (nvfp4_small, its layer rules replaced: the last block and the head in
    BF16), the schedule driven by the step hook."""
    config = llama3_debugmodel()
    converter = FP4GenConverter.Config(
        recipe="nvfp4_small", layers=["last 1 blocks : bf16", 'match "lm_head" : bf16']
    )
    spec = model_registry("debugmodel", converters=[converter])
    spec.post_optimizer_build_fn = step_hook(config.training.steps, spec.post_optimizer_build_fn)
    config.model_spec = spec
    return config
