"""fp4gen as a torchtitan (0.3) model converter: torchtitan's Llama 3 debug model converted with
a recipe through its converter protocol, built on the meta device, parallelized by torchtitan's
own ``parallelize_llama`` (FSDP2 on a one-rank gloo group, selective activation checkpointing,
per-block torch.compile) and trained a few steps on the CPU, with the precision schedule driven
by the optimizer step hook. The GPU test runs the same with CUDA, inductor and flex attention.

CPU only: torchtitan's flex attention has no backward on the CPU, so the CPU tests swap the
blocks' inner attention for torchtitan's ``ScaledDotProductAttention`` (causal); everything
else is the debug model as torchtitan builds it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# torchtitan 0.3 on a torch without what it imports (2.11 lacks
# torch.distributed.fsdp.DataParallelMeshDims; 2.13 has it) is a skip too, not a collection error
pytest.importorskip(
    "torchtitan.models.llama3",
    reason="needs torchtitan 0.3 (.[torchtitan]) and a torch it imports on",
    exc_type=ImportError,
)

import torchtitan.distributed.parallel_dims as titan_dims  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    ScaledDotProductAttention,
)
from torchtitan.models.common.linear import Linear as TitanLinear  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

import fp4gen  # noqa: E402
from fp4gen.errors import FP4GenError, RecipeError  # noqa: E402
from fp4gen.integrations.torchtitan import (  # noqa: E402
    FP4GenConverter,
    FP4GenLinear,
    layer_rules,
    optimizer_steps,
    step_hook,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VOCAB = 2048  # the debug model's
BLOCKS = 6


def debug_spec(
    converter: FP4GenConverter.Config | None, cpu_attention: bool = True, blocks: int | None = None
):
    """torchtitan's Llama 3 debug model config converted by ``converter`` through the model
    registry's converter list; with ``blocks``, its first N blocks, converted as the registry
    converts (``converter.build().convert``)."""
    if blocks is None:
        spec = model_registry("debugmodel", converters=None if converter is None else [converter])
    else:
        spec = model_registry("debugmodel")
        spec.model.layers = spec.model.layers[:blocks]
        if converter is not None:
            spec.model = converter.build().convert(spec.model)
    if cpu_attention:
        for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return spec


def materialize(model: torch.nn.Module, device: str, seed: int = 0) -> torch.nn.Module:
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def build(spec) -> torch.nn.Module:
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()  # what torchtitan's trainer checks after the converters
    return model


def kinds(model: torch.nn.Module) -> dict[str, str]:
    linears = (TitanLinear, FP4GenLinear)
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, linears)}


def test_converter_swaps_the_linear_configs_the_recipe_converts() -> None:
    """nvfp4_small keeps the last block and the head in BF16: blocks 0-4's five linear layers
    (fused qkv, wo, w1, w2, w3) become FP4GenLinear with the recipe's operand table, block 5
    and lm_head stay torchtitan's Linear; seeds are seed + the layer's index."""
    converter = FP4GenConverter.Config(recipe="nvfp4_small", seed=7)
    model = build(debug_spec(converter))
    got = kinds(model)
    converted = {n for n, k in got.items() if k == "FP4GenLinear"}
    assert converted == {
        f"layers.{b}.{name}"
        for b in range(BLOCKS - 1)
        for name in (
            "attention.qkv_linear.wqkv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    }
    assert got["lm_head"] == got["layers.5.attention.wo"] == "Linear"
    recipe = fp4gen.load_recipe("nvfp4_small")
    layer = model.get_submodule("layers.0.attention.wo")
    assert isinstance(layer, FP4GenLinear) and isinstance(layer, fp4gen.nn.Linear)
    assert layer.operands == recipe.operands
    assert layer.converted_by == "nvfp4_small"
    assert layer.name == "layers.0.attention.wo"
    # torchtitan's traverse order: lm_head is layer 0, then block 0's wqkv, wo, ...
    assert layer.seed == 7 + 2
    assert layer.weight.device.type == "meta"  # built on meta: torchtitan initializes later
    # one clock per conversion: set_step reaches every layer through the model
    fp4gen.set_step(model, 5, 10)
    assert {m.schedule.clock.step for m in model.modules() if isinstance(m, FP4GenLinear)} == {5}


def test_job_config_layer_rules_replace_the_recipes() -> None:
    converter = FP4GenConverter.Config(
        recipe="nvfp4_small", layers=["first 2 blocks : bf16", 'match "lm_head" : mxfp8_e4m3']
    )
    got = kinds(build(debug_spec(converter)))
    assert got["layers.1.feed_forward.w2"] == "Linear"  # first 2 blocks: bf16
    assert got["layers.2.feed_forward.w2"] == "FP4GenLinear"
    assert got["layers.5.feed_forward.w2"] == "FP4GenLinear"  # the recipe's last-block rule went
    assert got["lm_head"] == "FP4GenLinear"
    model = build(debug_spec(converter))
    head = model.get_submodule("lm_head")
    assert {spec.format.name for _, spec in head.operands.items()} == {"mxfp8_e4m3"}


def test_a_bad_layer_rule_names_its_index() -> None:
    recipe = fp4gen.load_recipe("nvfp4_small")
    with pytest.raises(RecipeError, match=r"layers\[1\] 'frist 2 blocks : bf16'.*unknown keyword"):
        layer_rules(recipe, ["last 1 blocks : bf16", "frist 2 blocks : bf16"])


def test_apply_to_model_spec_converts_and_chains_the_models_own_hook() -> None:
    """What FP4GenTrainer does before it builds the model: the model config converted, and the
    step hook registered after the model's own post_optimizer_build_fn."""
    from fp4gen.integrations.torchtitan import apply_to_model_spec

    spec = model_registry("debugmodel")
    called = []
    spec.post_optimizer_build_fn = lambda opt, parts, dims: called.append(len(parts))
    converter = apply_to_model_spec(spec, FP4GenConverter.Config(recipe="nvfp4_small"), 9)
    assert sum(not d.kept for d in converter.decisions) == 25
    assert isinstance(spec.model.layers[0].feed_forward.w1, FP4GenLinear.Config)
    model = materialize(build(debug_spec(FP4GenConverter.Config(recipe="nvfp4_small"))), "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    spec.post_optimizer_build_fn(optimizer, [model], None)
    assert called == [1]  # the model's own hook ran
    assert spec.post_optimizer_build_fn.hook.total_steps == 9
    assert optimizer_steps(optimizer) == 0  # SGD keeps no step: a fresh run's 0


def test_tensor_parallelism_is_refused() -> None:
    model = build(debug_spec(FP4GenConverter.Config(recipe="nvfp4_small")))

    class TwoWayTP:
        tp = 2

    layer = model.get_submodule("layers.0.attention.wo")
    with pytest.raises(FP4GenError, match="tensor parallelism"):
        layer.parallelize(TwoWayTP())


def test_step_hook_follows_the_optimizer_and_a_resumed_run() -> None:
    converter = FP4GenConverter.Config(recipe="nvfp4_small")
    model = materialize(build(debug_spec(converter, blocks=2)), "cpu")
    layer = model.get_submodule("layers.0.attention.wo")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    post_build = step_hook(total_steps=40)
    post_build(optimizer, [model], None)
    assert (layer.schedule.clock.step, layer.schedule.clock.total_steps) == (0, 40)
    tokens = torch.randint(0, VOCAB, (1, 8))
    for step in range(2):
        model(tokens).float().mean().backward()
        assert layer.schedule.clock.step == step  # the forward ran at this step
        optimizer.step()
        optimizer.zero_grad()
    assert layer.schedule.clock.step == 2 == optimizer_steps(optimizer)
    # a resumed run: a new hook on an optimizer that has taken 2 steps reads them at the first
    # forward (torchtitan loads the checkpoint after post_optimizer_build_fn)
    resumed = step_hook(total_steps=40)
    resumed(optimizer, [model], None)
    assert layer.schedule.clock.step == 0
    model(tokens)
    assert layer.schedule.clock.step == 2
    assert not model._forward_pre_hooks  # each first-forward hook removed itself


ROOT = Path(__file__).resolve().parent.parent


# what the example's _rendezvous writes into os.environ (a one-rank group on a free port)
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def process_state() -> tuple[dict[str, str | None], str]:
    return {k: os.environ.get(k) for k in RENDEZVOUS_VARS}, titan_dims.device_type


@contextlib.contextmanager
def example_process_state() -> Iterator[None]:
    """What the example's ``train`` changes for its whole process, put back after it: the
    rendezvous variables in ``os.environ`` and torchtitan's mesh device type (``"cpu"`` for a
    CPU run). Left behind, they reach the tests run after it in the process (a pytest-xdist
    worker): transformers' Trainer reads LOCAL_RANK as a distributed launch and runs a one-rank
    DistributedDataParallel that leaves its process group initialized, after which the
    example's own ``init_process_group`` fails ("trying to initialize the default process group
    twice"); a GPU run after a CPU one builds its mesh on the CPU."""
    (env, device_type) = process_state()
    try:
        yield
    finally:
        titan_dims.device_type = device_type
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def example():
    """examples/torchtitan/train_debug_model.py as a module (examples/ is not a package)."""
    name = "fp4gen_torchtitan_example"
    path = ROOT / "examples" / "torchtitan" / "train_debug_model.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_debug_model_trains_under_fsdp2_ac_and_compile_on_cpu() -> None:
    """examples/torchtitan/train_debug_model.py on the CPU, the debug model's first 3 blocks
    (a shorter run): torchtitan's own parallelize_llama (FSDP2 on one gloo rank, selective AC,
    each block compiled with fullgraph=True by the aot_eager backend: traced through fp4gen's
    custom ops) and 3 AdamW steps: the loss falls, the schedule's clock is at step 3, the
    converted layers are fp4gen's, torchtitan parallelized them and they ran. The blocks
    compile into at most three graphs (the converted blocks share one: their layers' ids are
    graph inputs, not constants; the BF16 block has its own; one recompile when fp4gen's
    non-finite mode is first read): one graph per block would hit dynamo's recompile limit at
    the ninth block under fullgraph=True (tests/test_compile_graph_breaks.py)."""
    before = process_state()
    with example_process_state():
        run = example().train("nvfp4_small", steps=3, device="cpu", seq=32, blocks=3)
    assert process_state() == before  # nothing of the run reaches the next test
    losses, model, hook, graphs = run.losses, run.model, run.hook, run.graphs
    assert losses[-1] < losses[0], losses
    assert all(torch.isfinite(torch.tensor(losses)))
    assert hook.step == 3
    layers = [m for m in model.modules() if isinstance(m, FP4GenLinear)]
    assert len(layers) == 10  # blocks 0 and 1; the last block and the head stay BF16
    assert all(m.schedule.clock.step == 3 for m in layers)
    assert all(m._forward_calls > 0 for m in layers)
    assert all(m._sharding_config is not None for m in layers)  # torchtitan parallelized them
    assert graphs <= 3, graphs


@pytest.mark.gpu
@CUDA
def test_debug_model_trains_under_fsdp2_ac_and_compile_on_gpu() -> None:
    """The GPU run of examples/torchtitan/train_debug_model.py: torchtitan's parallelize_llama
    on one GPU (FSDP2 with bf16 parameters,
    selective AC, inductor per block) and flex attention, the debug model converted with
    nvfp4_small, 10 AdamW steps: finite losses that fall, the schedule at step 10."""
    before = process_state()
    with example_process_state():
        run = example().train("nvfp4_small", steps=10, device="cuda")
    assert process_state() == before  # nothing of the run reaches the next test
    losses, model, hook, graphs = run.losses, run.model, run.hook, run.graphs
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    assert hook.step == 10
    assert sum(isinstance(m, FP4GenLinear) for m in model.modules()) == 25
    assert graphs <= 3, graphs


def test_trainer_config_takes_the_fp4gen_section_from_the_command_line(monkeypatch) -> None:
    """examples/torchtitan/config_registry.py through torchtitan's ConfigManager: the fp4gen
    section's fields on the command line, and the conversion FP4GenTrainer makes before it
    builds the model (the model config's linear layers, the step hook chained). Needs
    torchtitan's trainer (its data loaders import ``datasets``)."""
    pytest.importorskip("datasets", reason="torchtitan's trainer imports datasets")
    from torchtitan.config import ConfigManager

    from fp4gen.integrations.torchtitan import apply_to_model_spec

    monkeypatch.syspath_prepend(str(ROOT))
    config = ConfigManager().parse_args(
        [
            "--module", "examples.torchtitan", "--config", "llama3_debugmodel_fp4gen",
            "--fp4gen.recipe", "nvfp4", "--fp4gen.layers", "first 1 blocks : bf16",
            "--fp4gen.seed", "3", "--training.steps", "7",
        ]
    )  # fmt: skip
    assert (config.fp4gen.recipe, config.fp4gen.layers, config.fp4gen.seed) == (
        "nvfp4",
        ["first 1 blocks : bf16"],
        3,
    )
    converter = apply_to_model_spec(config.model_spec, config.fp4gen, config.training.steps)
    assert converter.recipe.name == "nvfp4"
    kept = {d.name for d in converter.decisions if d.kept}
    assert "layers.0.attention.wo" in kept and "layers.1.attention.wo" not in kept
    assert config.model_spec.post_optimizer_build_fn.hook.total_steps == 7


def test_the_examples_process_state_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``train`` changes for the process (the rendezvous it writes, the mesh device type a
    CPU run sets), on a process that had none of it and a CUDA device type: all put back."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name in RENDEZVOUS_VARS:  # an empty environment, restored by monkeypatch
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(titan_dims, "device_type", "cuda")
    module = example()
    with example_process_state():
        module._rendezvous()
        titan_dims.device_type = "cpu"  # what train(device="cpu") does
        assert os.environ["LOCAL_RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    assert process_state() == (dict.fromkeys(RENDEZVOUS_VARS), "cuda")
