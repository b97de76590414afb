"""FP4GenCallback under transformers' Trainer (examples/hf_trainer.py): the model is converted at
train start with the Trainer's max_steps, the optimizer the Trainer made before that trains the
converted layers' parameters, set_step follows the optimizer steps (once per step under gradient
accumulation), a schedule at 50% switches the forward pass at step ceil(0.5 * max_steps), and
the step-tagged telemetry lands in output_dir. A tiny Llama from a config, no download."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' Trainer needs it

import fp4gen  # noqa: E402
from fp4gen.errors import ArgumentError, FP4GenError, RecipeError  # noqa: E402
from fp4gen.integrations.hf_trainer import TELEMETRY_FILE, FP4GenCallback  # noqa: E402
from fp4gen.runtime.convert import count_converted  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FORWARD = {"fprop.activation", "fprop.weight"}
BACKWARD = {"dgrad.gradient", "dgrad.weight", "wgrad.activation", "wgrad.gradient"}
FIRST_BLOCK = 7  # a Llama block's linear layers: q, k, v, o, gate, up, down


def load_example():
    """examples/hf_trainer.py as a module (examples/ is not a package)."""
    name = "fp4gen_example_hf_trainer"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "hf_trainer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# what torch.distributed launchers set: transformers' Trainer (through accelerate) reads
# LOCAL_RANK as a distributed launch and then runs a DistributedDataParallel model
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """The rendezvous variables out of ``os.environ`` while the example runs, put back after:
    the run is a single-process one whatever an earlier test in the process (a pytest-xdist
    worker) left there (a one-rank torch.distributed run writes them)."""
    saved = {k: os.environ.pop(k) for k in RENDEZVOUS_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def tf32_setting() -> tuple[str | bool, ...]:
    """The process's TF32 setting, read through the API transformers sets it with."""
    if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9
        return (torch.backends.fp32_precision,)
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@contextlib.contextmanager
def tf32_setting_kept() -> Iterator[None]:
    """The TF32 setting put back after the block: on a CUDA machine
    ``TrainingArguments(torch_compile=True)`` turns TF32 on for the whole process (every fp32
    matmul of every later test in it, a pytest-xdist worker's share of the suite)."""
    saved = tf32_setting()
    try:
        yield
    finally:
        if hasattr(torch.backends, "fp32_precision"):
            torch.backends.fp32_precision = saved[0]
        else:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def run(tmp_path: Path, *extra: str, steps: int = 8):
    example = load_example()
    with single_process():
        return example, example.main(
            ["--steps", str(steps), "--telemetry", "1", "--out", str(tmp_path), *extra]
        )


def check_run(example, result, steps: int, tmp_path: Path, calls_per_step: int = 1) -> None:
    """What every run must show, on any device."""
    model = result.model
    # converted at train start: nvfp4_small keeps the last block and lm_head, so the first
    # block's seven layers are fp4gen Linears
    assert count_converted(model) == FIRST_BLOCK
    assert isinstance(model.model.layers[0].self_attn.q_proj, fp4gen.nn.Linear)
    assert type(model.model.layers[1].self_attn.q_proj) is torch.nn.Linear
    # the optimizer made before on_train_begin holds the converted layers' parameters
    optimized = {id(p) for group in result.trainer.optimizer.param_groups for p in group["params"]}
    for layer in model.model.layers[0].modules():
        if isinstance(layer, fp4gen.nn.Linear):
            assert id(layer.weight) in optimized
    torch.manual_seed(0)
    fresh = example.build_model(64, 2, 4, 32)
    trained = model.model.layers[0].mlp.down_proj.weight.detach().float().cpu()
    assert not torch.equal(trained, fresh.model.layers[0].mlp.down_proj.weight.float())
    # set_step reached the last step, and the clock knows the run's length
    assert result.steps == steps
    assert result.callback.step == steps - 1
    assert model._fp4gen_clock.step == steps - 1
    assert model._fp4gen_clock.total_steps == steps
    assert len(result.losses) == steps
    assert all(math.isfinite(loss) and 0 < loss < 10 for loss in result.losses)
    # at 50% forward : bf16 -> from step ceil(0.5 * steps) the forward operands are BF16 and
    # record nothing; the backward ones stay NVFP4 to the end
    switch = math.ceil(0.5 * steps)
    path = tmp_path / TELEMETRY_FILE
    assert result.callback.telemetry_path == path
    records = json.loads(path.read_text())["records"]
    assert {r["recipe"] for r in records} == {"nvfp4_small_switch"}
    forward_steps = {r["step"] for r in records if r["operand"] in FORWARD}
    backward_steps = {r["step"] for r in records if r["operand"] in BACKWARD}
    assert forward_steps == set(range(switch))
    assert backward_steps == set(range(steps))
    # every converted layer records each operand once per micro-batch of a recorded step
    q_act = [
        r
        for r in records
        if r["layer"] == "model.layers.0.self_attn.q_proj" and r["operand"] == "fprop.activation"
    ]
    assert [r["step"] for r in q_act] == [s for s in range(switch) for _ in range(calls_per_step)]
    assert [r["call"] for r in q_act] == list(range(switch * calls_per_step))
    assert all(0 < r["rel_error"] < 0.5 for r in records)


def test_trainer_converts_follows_the_schedule_and_writes_telemetry(tmp_path: Path) -> None:
    example, result = run(tmp_path)
    assert next(result.model.parameters()).device.type == "cpu" or torch.cuda.is_available()
    check_run(example, result, 8, tmp_path)


def test_gradient_accumulation_sets_the_step_once_per_optimizer_step(tmp_path: Path) -> None:
    example, result = run(tmp_path, "--accumulation", "2", steps=4)
    check_run(example, result, 4, tmp_path, calls_per_step=2)


def test_trainer_with_torch_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainingArguments(torch_compile=True) wraps the model before on_train_begin; it is traced
    on its first call, after the conversion, and the schedule switches inside the custom ops
    (no retrace needed). The TF32 setting it makes for the process on a CUDA machine (made here
    too) is put back after the run."""
    import transformers
    import transformers.training_args

    # as on a CUDA machine: the arguments then turn TF32 on (transformers' enable_tf32)
    monkeypatch.setattr(transformers.training_args, "is_torch_tf32_available", lambda: True)
    example = load_example()
    torch.manual_seed(0)
    model = example.build_model(64, 2, 4, 32)
    callback = FP4GenCallback(example.SWITCH_RECIPE, telemetry_every=1)
    before = tf32_setting()
    with single_process(), tf32_setting_kept():
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=4,
            per_device_train_batch_size=4,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            torch_compile=True,
            torch_compile_backend="aot_eager",
        )
        assert tf32_setting() != before  # what the test guards against: TF32 on
        torch._dynamo.reset()
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=example.RandomTokens(16, 32, 0),
            callbacks=[callback],
        )
        trainer.train()
    assert tf32_setting() == before
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert count_converted(model) == FIRST_BLOCK
    assert model._fp4gen_clock.step == 3
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    records = callback.records()
    assert {r["step"] for r in records if r["operand"] in FORWARD} == {0, 1}
    assert {r["step"] for r in records if r["operand"] in BACKWARD} == {0, 1, 2, 3}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_on_the_gpu(tmp_path: Path) -> None:
    """The same run on CUDA (bf16, the generated kernels)."""
    example, result = run(tmp_path, steps=8)
    assert next(result.model.parameters()).device.type == "cuda"
    check_run(example, result, 8, tmp_path)


def test_a_rendezvous_left_in_the_environment_does_not_make_the_run_distributed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LOCAL_RANK and the rest of a one-rank rendezvous in the environment (what an earlier
    test's torch.distributed run in this process may leave): the example still trains as one
    process, with no process group left behind, and the variables are there again after it."""
    import torch.distributed as dist
    from transformers.training_args import ParallelMode

    leaked = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29513", RANK="0", WORLD_SIZE="1")
    for name, value in {**leaked, "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    _, result = run(tmp_path, steps=2)
    assert result.trainer.args.parallel_mode is not ParallelMode.DISTRIBUTED
    assert not dist.is_initialized()
    assert type(result.trainer.model_wrapped) is type(result.model)  # no DDP wrapper
    assert {k: os.environ.get(k) for k in RENDEZVOUS_VARS} == {**leaked, "LOCAL_RANK": "0"}


# -- the callback's own rules, without a Trainer -------------------------------------------


def tiny_llama():
    return load_example().build_model(64, 2, 4, 32)


def state(max_steps: int, global_step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(max_steps=max_steps, global_step=global_step, is_world_process_zero=True)


def test_a_resumed_run_starts_at_its_global_step(tmp_path: Path) -> None:
    model = tiny_llama()
    callback = FP4GenCallback("nvfp4_small")
    args = SimpleNamespace(output_dir=str(tmp_path), fsdp=None, deepspeed=None)
    callback.on_train_begin(args, state(100, 40), None, model=model)
    assert model._fp4gen_clock.step == 40 and model._fp4gen_clock.total_steps == 100
    callback.on_step_begin(args, state(100, 41), None, model=model)
    assert model._fp4gen_clock.step == 41 and callback.step == 41


def test_a_model_converted_before_the_trainer_keeps_its_layers(tmp_path: Path) -> None:
    """Under FSDP the model is converted before the Trainer shards it: the callback's convert
    with the same recipe and options only sets the run's length."""
    model = fp4gen.convert(tiny_llama(), "nvfp4_small", seed=3)
    q_proj = model.model.layers[0].self_attn.q_proj
    args = SimpleNamespace(output_dir=str(tmp_path), fsdp="full_shard", deepspeed=None)
    FP4GenCallback("nvfp4_small", seed=3).on_train_begin(args, state(50), None, model=model)
    assert model.model.layers[0].self_attn.q_proj is q_proj
    assert model._fp4gen_clock.total_steps == 50
    with pytest.raises(FP4GenError, match=r"seed=3.*seed=4"):  # other options: refused
        FP4GenCallback("nvfp4_small", seed=4).on_train_begin(args, state(50), None, model=model)


@pytest.mark.parametrize(
    ("field", "value", "name"),
    [("fsdp", "full_shard", "FSDP"), ("deepspeed", "ds.json", "DeepSpeed")],
)
def test_a_sharded_model_must_be_converted_first(
    tmp_path: Path, field: str, value: str, name: str
) -> None:
    model = tiny_llama()
    args = SimpleNamespace(output_dir=str(tmp_path), fsdp=None, deepspeed=None)
    setattr(args, field, value)
    with pytest.raises(
        FP4GenError, match=f"prepared the model for {name}.*before building the Trainer"
    ):
        FP4GenCallback("nvfp4_small").on_train_begin(args, state(10), None, model=model)
    assert count_converted(model) == 0  # left as it was


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(ArgumentError, match="telemetry_every must be >= 0"):
        FP4GenCallback("nvfp4_small", telemetry_every=-1)
    with pytest.raises(ArgumentError, match="telemetry_every must be an int"):
        FP4GenCallback("nvfp4_small", telemetry_every=True)
    with pytest.raises(ArgumentError, match="telemetry_file must be a plain name"):
        FP4GenCallback("nvfp4_small", telemetry_every=1, telemetry_file="../t.json")
    with pytest.raises(ArgumentError, match="recipe must be a Recipe"):
        FP4GenCallback(3)  # type: ignore[arg-type]
    with pytest.raises(RecipeError):
        FP4GenCallback("recipe x\nlayers {\n  nonsense\n}\n")
    with pytest.raises(FP4GenError, match="before on_train_begin"):
        FP4GenCallback("nvfp4_small").on_step_begin(None, state(10), None, model=None)
