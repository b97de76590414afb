"""Train torchtitan's Llama 3 debug model with an fp4gen recipe, parallelized as torchtitan does.

The model config comes from torchtitan's model registry with ``FP4GenConverter`` among its
converters (fp4gen.integrations.torchtitan); the model is built on the meta device and handed to
torchtitan's own ``parallelize_llama`` (FSDP2 over this process's ranks, activation
checkpointing, each block compiled with fullgraph=True), then materialized and initialized by
torchtitan; ``step_hook`` drives the precision schedule from the optimizer. Random tokens, no
tokenizer or data set: a test of the pieces, not a training run (for that, the Trainer configs
in config_registry.py beside this file).

    pip install -e ".[torchtitan]"
    python examples/torchtitan/train_debug_model.py --steps 10            # CUDA, else the CPU
    torchrun --nproc_per_node=2 examples/torchtitan/train_debug_model.py  # FSDP2 over 2 GPUs

On the CPU (gloo) the blocks' flex attention, which has no backward there, is swapped for
torchtitan's causal ``ScaledDotProductAttention``, the parameters stay fp32 and the blocks
compile with ``aot_eager``; on CUDA: flex attention, bf16 parameters under FSDP2, inductor.
Prints the loss per step and the number of graphs dynamo made.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as titan_dims
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

from fp4gen.integrations.torchtitan import FP4GenConverter, StepHook, step_hook

VOCAB = 2048  # the debug model's vocabulary


@dataclass
class Run:
    """What a run gives back: the loss per step, the model (its fp4gen layers), the step hook
    and dynamo's distinct graphs."""

    losses: list[float] = field(default_factory=list)
    model: Any = None
    hook: StepHook | None = None
    graphs: int = 0


def _rendezvous() -> None:
    """One rank on a free local port, unless torchrun launched this process (it sets the
    rendezvous)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ["LOCAL_RANK"] = "0"


def train(
    recipe: str = "nvfp4_small",
    rules: list[str] | None = None,
    steps: int = 10,
    device: str | None = None,
    backend: str | None = None,
    ac: str = "selective",
    seq: int = 64,
    batch: int = 2,
    blocks: int | None = None,
) -> Run:
    """``steps`` AdamW steps of the debug model converted with ``recipe`` (and ``rules``: layer
    rules replacing the recipe's). ``backend``: the blocks' torch.compile backend (None: inductor
    on CUDA, aot_eager on the CPU; "none": no compile); ``ac``: selective, full or none;
    ``blocks``: keep only the first N of the debug model's 6 blocks (a shorter CPU run)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = backend or ("inductor" if device == "cuda" else "aot_eager")
    _rendezvous()
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    run = Run()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        converter = FP4GenConverter.Config(recipe=recipe, layers=list(rules or []))
        spec = model_registry("debugmodel")
        if blocks is not None:
            spec.model.layers = spec.model.layers[:blocks]
        spec.model = converter.build().convert(spec.model)  # as the registry's converters do
        training = TrainingConfig(local_batch_size=batch, seq_len=seq, steps=steps)
        if device == "cpu":
            for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
                setattr(parent, attr, ScaledDotProductAttention.Config())
            titan_dims.device_type = "cpu"  # torchtitan builds its meshes on its device type
            training.mixed_precision_param = "float32"
        parallelism = ParallelismConfig()
        # what torchtitan's Trainer has the model config do (update_from_config, which imports
        # the trainer and its data loaders): every module's sharding declarations, the
        # converted layers' too (declarations for axes not in use are skipped)
        set_llama3_sharding_config(spec.model, enable_sp=parallelism.enable_sequence_parallel)
        dims = ParallelDims(
            dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world,
            spmd_backend=parallelism.spmd_backend,
        )  # fmt: skip
        dims.build_mesh()
        with torch.device("meta"):
            model = spec.model.build()
        model.verify_module_protocol()
        compile_config = CompileConfig(
            enable=backend != "none", components=["model"], backend=backend
        )
        ac_config = {"selective": SelectiveAC.Config(), "full": FullAC.Config()}.get(ac)
        model = spec.parallelize_fn(
            model,
            parallel_dims=dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=ac_config,
            dump_folder="",
        )
        model.to_empty(device=device)
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        post_build = step_hook(total_steps=steps)
        post_build(optimizer, [model], dims)
        tokens = torch.randint(
            0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(1 + rank)
        ).to(device)
        torch._dynamo.utils.counters.clear()
        for _ in range(steps):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.losses.append(loss.item())
        run.model, run.hook = model, post_build.hook
        run.graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return run
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="nvfp4_small", help="a .fp4r path or shipped name")
    parser.add_argument(
        "--rule",
        action="append",
        default=[],
        help='a layer rule replacing the recipe\'s (repeatable), e.g. "last 1 blocks : bf16"',
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--compile-backend", default=None, help="inductor, aot_eager or none")
    parser.add_argument("--ac", choices=["selective", "full", "none"], default="selective")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=None, help="keep the first N blocks")
    args = parser.parse_args()
    run = train(
        args.recipe, args.rule, args.steps, args.device, args.compile_backend, args.ac,
        args.seq, args.batch, args.blocks,
    )  # fmt: skip
    for step, loss in enumerate(run.losses, 1):
        print(f"step {step:3d}  loss {loss:.4f}")
    print(f"dynamo graphs: {run.graphs}; schedule at step {run.hook.step if run.hook else '-'}")


if __name__ == "__main__":
    main()
