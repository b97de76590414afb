"""Fine-tune a Hugging Face transformers model with an fp4gen recipe through ``Trainer``.

A tiny Llama is built from a config (no download: hidden 64, 2 decoder layers, a vocabulary of
256 tokens) and trained for a few steps on random tokens by ``transformers.Trainer``;
``FP4GenCallback`` converts it when training begins and keeps the recipe's precision schedule in
step with the Trainer. Runs on CUDA when present (bf16), else on the CPU.

    pip install -e ".[hf]"
    python examples/hf_trainer.py --steps 20 --telemetry 5

Prints the layer plan (``fp4gen.show_plan``), the Trainer's loss per step, and where the
telemetry went (``fp4gen report OUT/fp4gen_telemetry.json`` draws it).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fp4gen
from fp4gen.integrations.hf_trainer import FP4GenCallback

VOCAB = 256
# The default recipe: nvfp4_small (the last block and lm_head in BF16, so a 2-layer model
# trains its first block in NVFP4), with the forward pass switched to BF16 halfway through,
# as the NVFP4 paper's Appendix D switches it late in training (nvfp4_bf16_switch).
SWITCH_RECIPE = """\
recipe nvfp4_small_switch "nvfp4_small, forward pass in BF16 from 50% of training"
extends "nvfp4_small.fp4r"

schedule {
    at 50% forward : bf16
}
"""


class RandomTokens(torch.utils.data.Dataset):
    """``count`` sequences of ``seq`` random tokens (fixed by ``seed``), as causal-LM examples."""

    def __init__(self, count: int, seq: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (count, seq), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[index]
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself


def build_model(hidden: int, layers: int, heads: int, seq: int) -> torch.nn.Module:
    """A randomly initialized Llama from a config (no download)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=VOCAB,
        max_position_embeddings=seq,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


@dataclass
class RunResult:
    """What a run left: the model, the Trainer, the callback, and the loss per step."""

    model: torch.nn.Module
    trainer: Any  # transformers.Trainer
    callback: FP4GenCallback
    losses: list[float]
    steps: int  # optimizer steps the Trainer took


def main(argv: list[str] | None = None) -> RunResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe",
        default=SWITCH_RECIPE,
        help="a .fp4r path, a shipped name or recipe text (default: nvfp4_small, forward in "
        "BF16 from 50%% of the steps)",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--telemetry", type=int, default=0, help="record every N-th step")
    parser.add_argument("--out", type=Path, default=Path("hf_trainer_out"), help="output_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")

    import transformers

    cuda = torch.cuda.is_available()
    torch.manual_seed(args.seed)
    model = build_model(args.hidden, args.layers, args.heads, args.seq)
    callback = FP4GenCallback(args.recipe, seed=args.seed, telemetry_every=args.telemetry)
    training = transformers.TrainingArguments(
        output_dir=str(args.out),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(args.steps // 20, 1),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=not cuda,
        bf16=cuda,
        seed=args.seed,
    )
    examples = args.steps * args.batch * args.accumulation
    trainer = transformers.Trainer(
        model=model,
        args=training,
        train_dataset=RandomTokens(examples, args.seq, args.seed),
        callbacks=[callback],
    )
    trainer.train()
    print(fp4gen.show_plan(model))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    for step, loss in enumerate(losses, start=1):
        print(f"step {step:4d}  loss {loss:.4f}")
    if callback.telemetry_path is not None:
        print(f"telemetry: {callback.telemetry_path} ({len(callback.records())} records)")
    if not all(math.isfinite(loss) for loss in losses):
        print("warning: a loss was not finite")
    return RunResult(model, trainer, callback, losses, trainer.state.global_step)


if __name__ == "__main__":
    main()
