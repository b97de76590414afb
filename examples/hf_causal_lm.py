"""Train a Hugging Face transformers causal LM with an fp4gen recipe.

The model is built from a config (no download): Llama by default, or Qwen2, Qwen3, Mistral or
GPT-2, with a byte vocabulary (256 tokens). It trains on bytes: by default the Python standard
library's source files (as ``fp4gen demo`` does), or any file given with ``--data``; the last
10% is held out. ``--recipe bf16`` trains the unconverted model as the baseline. On CUDA every
model runs under bf16 autocast (so the layers a recipe keeps in high precision run in bf16).

    pip install -e ".[hf]"
    python examples/hf_causal_lm.py --arch llama --hidden 256 --layers 4 --steps 200 \\
        --batch 16 --seq 256 --recipe recipes/nvfp4_small.fp4r

Prints which layers run in what (``fp4gen.show_plan``), then step, loss, tokens/s and ms/step,
and the held-out loss at the end.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch

import fp4gen
from fp4gen.demo.data import ByteBatches, stdlib_corpus

VOCAB = 256  # bytes
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt2")


def build_model(arch: str, hidden: int, layers: int, heads: int, seq: int) -> torch.nn.Module:
    """A randomly initialized causal LM of ``arch`` from a config (no download)."""
    import transformers

    if arch == "gpt2":
        config: Any = transformers.GPT2Config(
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            vocab_size=VOCAB,
            n_positions=seq,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config)
    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }
    config_name, model_name = names[arch]
    if not hasattr(transformers, model_name):
        raise SystemExit(f"transformers {transformers.__version__} has no {model_name}")
    extra = {"head_dim": hidden // heads} if arch == "qwen3" else {}
    config = getattr(transformers, config_name)(
        hidden_size=hidden,
        # SwiGLU's 8/3, rounded to a multiple of every shipped block (FP8 blockwise: 128)
        intermediate_size=128 * math.ceil(8 * hidden / 3 / 128),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=VOCAB,
        max_position_embeddings=seq,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
        **extra,
    )
    return getattr(transformers, model_name)(config)


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(steps // 20, 1)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def held_out_loss(
    model: torch.nn.Module, data: ByteBatches, batch: int, batches: int, device: torch.device
) -> float:
    model.eval()
    losses = []
    for _ in range(batches):
        x, _ = data.batch(batch, "val")
        x = x.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses.append(float(model(input_ids=x, labels=x).loss))
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks")
    parser.add_argument("--heads", type=int, default=0, help="attention heads (0: hidden / 64)")
    parser.add_argument(
        "--recipe",
        default="recipes/nvfp4_small.fp4r",
        help="a .fp4r path or shipped recipe name, or bf16 for the unconverted baseline",
    )
    parser.add_argument("--data", type=Path, help="train on this file's bytes (default: stdlib)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads = args.heads or max(1, args.hidden // 64)
    if args.hidden % heads:
        parser.error(f"--hidden {args.hidden} is not a multiple of --heads {heads}")
    corpus = args.data.read_bytes() if args.data else stdlib_corpus()
    if len(corpus) < 20 * (args.seq + 1):
        parser.error(f"{len(corpus)} bytes of data are too few for --seq {args.seq}")
    data = ByteBatches(corpus, args.seq, seed=args.seed)

    torch.manual_seed(args.seed)
    model = build_model(args.arch, args.hidden, args.layers, heads, args.seq).to(device)
    converted = args.recipe != "bf16"
    if converted:
        recipe = fp4gen.load_recipe(args.recipe)
        fp4gen.convert(model, recipe, seed=args.seed, total_steps=args.steps)
        print(fp4gen.show_plan(model))
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.arch}: {params / 1e6:.2f}M parameters, {args.layers} layers, width "
        f"{args.hidden}, {heads} heads; recipe {args.recipe}; {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    tokens_per_step = args.batch * args.seq
    sync(device)
    window_start, window_steps = time.perf_counter(), 0
    for step in range(args.steps):
        if converted:
            fp4gen.set_step(model, step)  # drives the recipe's precision schedule
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        x, _ = data.batch(args.batch)
        x = x.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window_steps += 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            sync(device)  # one read-back per log line, not per step
            elapsed = time.perf_counter() - window_start
            print(
                f"step {step + 1:5d}  loss {float(loss.detach()):.4f}  "
                f"{tokens_per_step * window_steps / elapsed:9.0f} tokens/s  "
                f"{1000 * elapsed / window_steps:8.1f} ms/step"
            )
            window_start, window_steps = time.perf_counter(), 0
    val = held_out_loss(model, data, args.batch, args.eval_batches, device)
    print(f"held-out loss {val:.4f} ({val / math.log(2):.3f} bits per byte)")


if __name__ == "__main__":
    main()
