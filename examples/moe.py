"""Train a Mixture-of-Experts model with an fp4gen recipe: a tiny Qwen3-MoE on the CPU.

A Qwen3-MoE is built from a config (no download: hidden 64, 2 decoder layers of 8 experts,
top-2, a vocabulary of 256 tokens); ``fp4gen.convert`` replaces each layer's experts module by a
``GroupedExperts`` that runs every expert's GEMMs in the recipe's formats (the attention
projections are converted as usual). The plan shows each experts module and what it runs in;
then a few AdamW steps on the bytes of a short text, the loss per step, and the share of the
parameters trained quantized. Runs on CUDA when present (bf16 autocast; on sm_90a the experts'
GEMMs are grouped: docs/moe.md), else on the CPU.

    pip install -e ".[hf]"
    python examples/moe.py --steps 10                 # nvfp4_small
    python examples/moe.py --recipe fp8_blockwise --grouped
    python examples/moe.py --export OUT               # then a checkpoint vLLM's loader reads

``--grouped`` runs the experts' GEMMs grouped (one torch._grouped_mm per GEMM) also on the
CPU; ``--export OUT`` writes the trained model with its experts per expert in Model
Optimizer's NVFP4 layout (``fp4gen.export_quantized``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import nn

import fp4gen
from fp4gen.runtime.experts import GroupedExperts

VOCAB = 256
TEXT = (
    b"Mixture-of-Experts models route each token to a few experts; every expert is a small "
    b"feed-forward network, and the router learns which ones a token needs. "
) * 4


@dataclass
class Result:
    model: nn.Module
    losses: list[float]
    plan: str


def build(experts: int, device: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    return transformers.Qwen3MoeForCausalLM(config).to(device)


def batches(seq: int, batch: int, steps: int, device: str) -> list[torch.Tensor]:
    data = torch.tensor(list(TEXT), dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        out.append(torch.stack([data[s : s + seq] for s in starts.tolist()]).to(device))
    return out


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="nvfp4_small", help="a shipped name or a path")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--grouped", action="store_true", help="grouped expert GEMMs anywhere")
    parser.add_argument("--export", default=None, metavar="OUT", help="write a checkpoint here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    model = fp4gen.convert(build(args.experts, device), args.recipe, total_steps=args.steps)
    if args.grouped:
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                module.grouped = True
    plan = fp4gen.show_plan(model)
    print(plan)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            why = module.loop_reason(module.operands, torch.device(device))
            print(f"{module.name}: {'grouped GEMMs' if why is None else 'per expert: ' + why}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step, ids in enumerate(batches(args.seq, args.batch, args.steps, device)):
        fp4gen.set_step(model, step, args.steps)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        print(f"step {step:3d}  loss {losses[-1]:.4f}")

    if args.export:
        report = fp4gen.export_quantized(model, args.export, overwrite=True)
        print(report.table())
        print(f"wrote {args.export}: {report.engine}")
    return Result(model, losses, plan)


if __name__ == "__main__":
    main()
