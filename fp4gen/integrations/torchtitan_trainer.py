"""torchtitan's ``Trainer`` with an ``fp4gen`` config section: ``FP4GenTrainer``.

A job config built on ``FP4GenTrainer.Config`` (examples/torchtitan/config_registry.py) takes
``--fp4gen.recipe PATH``, ``--fp4gen.layers RULE ...``, ``--fp4gen.seed`` and
``--fp4gen.backend`` on torchtitan's command line; the trainer converts the model config with
``fp4gen.integrations.torchtitan.FP4GenConverter`` before the model is built and chains the
step hook into the model's ``post_optimizer_build_fn``. Kept apart from the converter because
torchtitan's trainer imports its data loaders (the ``datasets`` package), which the converter
does not need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4gen.integrations.torchtitan import FP4GenConverter, apply_to_model_spec

try:
    from torchtitan.trainer import Trainer
except ImportError as err:  # the optional extra
    raise ImportError(
        "fp4gen.integrations.torchtitan_trainer needs torchtitan 0.3 and its trainer's "
        "dependencies (datasets): pip install -e '.[torchtitan]'"
    ) from err


class FP4GenTrainer(Trainer):
    """torchtitan's ``Trainer`` with an ``fp4gen`` config section: the model is converted with
    ``fp4gen.recipe`` (and its layer rules) before it is built, with the run's ``training.steps``
    as its length, and the step hook keeps the schedule on the optimizer's step.
    ``fp4gen.recipe = ""`` trains the model unconverted."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fp4gen: FP4GenConverter.Config = field(default_factory=FP4GenConverter.Config)

    def __init__(self, config: Config) -> None:
        if config.fp4gen.recipe:
            assert config.model_spec is not None, "model_spec must be set before the Trainer"
            self.fp4gen_converter = apply_to_model_spec(
                config.model_spec, config.fp4gen, config.training.steps
            )
        super().__init__(config)


__all__ = ["FP4GenTrainer"]
