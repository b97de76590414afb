"""The models a sweep trains, built from a config (nothing is downloaded).

Three families: the demo's GPT (``fp4gen.demo.gpt``, sizes as ``fp4gen demo --size``),
transformers' Llama and transformers' Qwen3-MoE (both need the ``hf`` extra; the MoE models'
experts run as ``fp4gen.runtime.experts.GroupedExperts`` under a recipe, docs/moe.md). The
Llama sizes have more blocks than the GPT's so that the papers' layer rules (``nvfp4``: first 2
and last 8 blocks in BF16; ``mxfp4``: last 8) leave quantized blocks: ``llama-medium`` keeps 6
of its 16 blocks in NVFP4 under ``nvfp4``.

This module imports no torch at import time: the CLI builds its help from the table.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fp4gen.errors import FP4GenError

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "gpt", "llama" or "qwen3_moe"
    layers: int
    width: int
    heads: int
    context: int
    lr: float  # the default peak learning rate for this size
    note: str
    # Llama rounds SwiGLU's 8/3 width up to a multiple of this (Llama 2 uses 256: 11008 at 4096)
    mlp_multiple: int = 64
    # qwen3_moe: experts per MoE block (every block is one), experts per token, each expert's
    # SwiGLU width
    experts: int = 0
    topk: int = 0
    expert_width: int = 0

    @property
    def intermediate(self) -> int:
        """The MLP's hidden size: 4x for the GPT, SwiGLU's 8/3 rounded up to ``mlp_multiple``
        for Llama, each expert's for Qwen3-MoE."""
        if self.family == "gpt":
            return 4 * self.width
        if self.family == "qwen3_moe":
            return self.expert_width
        m = self.mlp_multiple
        return m * math.ceil(8 * self.width / 3 / m)

    def parameters(self, vocab: int = 256) -> int:
        """The exact parameter count of the model built for ``vocab`` tokens."""
        w, i = self.width, self.intermediate
        if self.family == "gpt":
            # per block: 2 LayerNorms, qkv and proj with biases, fc1 and fc2 with biases
            block = 4 * w + (3 * w * w + 3 * w) + (w * w + w) + (w * i + i) + (i * w + w)
            return vocab * w + self.context * w + self.layers * block + 2 * w + vocab * w
        if self.family == "qwen3_moe":
            # q, k, v, o without biases, q/k RMSNorms of a head, the router, each expert's
            # gate/up/down, 2 RMSNorms; untied head
            e, head = self.experts, w // self.heads
            block = 4 * w * w + 2 * head + e * w + e * 3 * w * i + 2 * w
            return vocab * w + self.layers * block + w + vocab * w
        # per block: q, k, v, o without biases, gate/up/down, 2 RMSNorms; untied head
        block = 4 * w * w + 3 * w * i + 2 * w
        return vocab * w + self.layers * block + w + vocab * w


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # the demo's sizes (fp4gen.demo.train.SIZES), so the two tools train the same models
        ModelSpec("gpt-tiny", "gpt", 4, 64, 4, 64, 3e-3, "a CPU: seconds per 100 steps in bf16"),
        ModelSpec("gpt-small", "gpt", 6, 384, 6, 128, 3e-3, "a GPU"),
        ModelSpec("gpt-medium", "gpt", 8, 768, 8, 256, 3e-3, "a GPU"),
        ModelSpec("llama-tiny", "llama", 4, 64, 4, 64, 3e-3, "a CPU"),
        ModelSpec("llama-small", "llama", 12, 384, 6, 128, 1e-3, "a GPU"),
        ModelSpec("llama-medium", "llama", 16, 768, 12, 256, 6e-4, "a GPU; the ablations"),
        # few blocks, real width: FP8 and NVFP4 GEMMs at the sizes where they pay on Hopper; the
        # MLP is Llama 2's 11008 wide, a multiple of every shipped block size (the 64-rounded
        # 10944 is not a multiple of 128, so FP8's 1x128 blocks would leave the fused kernels)
        ModelSpec("llama-wide", "llama", 4, 4096, 32, 256, 3e-4, "a GPU; hidden 4096", 256),
        # Mixture-of-Experts: every block's MLP a Qwen3-MoE sparse block (router, top-k)
        ModelSpec(
            "qwen3moe-tiny",
            "qwen3_moe",
            4,
            64,
            4,
            64,
            3e-3,
            "a CPU; 4 experts, top-2",
            experts=4,
            topk=2,
            expert_width=64,
        ),
        ModelSpec(
            "qwen3moe-small",
            "qwen3_moe",
            8,
            512,
            8,
            256,
            1e-3,
            "a GPU; 8 experts, top-2",
            experts=8,
            topk=2,
            expert_width=512,
        ),
    )
}
ALIASES = {"gpt": "gpt-tiny", "llama": "llama-tiny"}


def model_table(vocab: int = 256) -> str:
    """The --help table of model names, shapes, parameter counts and default learning rates."""
    lines = [
        "  name          blocks x width  heads  context  parameters  default --lr  for",
    ]
    for spec in MODELS.values():
        params = spec.parameters(vocab)
        lines.append(
            f"  {spec.name:<13} {spec.layers:>6} x {spec.width:<5}  {spec.heads:>5}  "
            f"{spec.context:>7}  {params / 1e6:>9.2f}M  {spec.lr:>12g}  {spec.note}"
        )
    return "\n".join(lines)


def find_model(name: str) -> ModelSpec:
    """The spec a --model argument names (``gpt`` is ``gpt-tiny``), else a one-line error."""
    spec = MODELS.get(ALIASES.get(name, name))
    if spec is None:
        known = ", ".join([*MODELS, *ALIASES])
        raise FP4GenError(f"--model {name!r}: unknown model; expected one of {known}")
    return spec


def require_family(spec: ModelSpec) -> None:
    """Fail now, before any training, when the model's library is missing."""
    if spec.family == "gpt":
        return
    cls = "LlamaForCausalLM" if spec.family == "llama" else "Qwen3MoeForCausalLM"
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as err:
        raise FP4GenError(
            f"--model {spec.name} needs transformers, which is not installed "
            f"({err}); install it with: pip install 'fp4gen[hf]'"
        ) from None
    if not hasattr(transformers, cls):
        raise FP4GenError(
            f"--model {spec.name}: transformers {transformers.__version__} has no {cls}"
        )


def build_model(spec: ModelSpec, vocab: int) -> nn.Module:
    """A randomly initialized model from the global torch RNG (the caller seeds it)."""
    if spec.family == "gpt":
        from fp4gen.demo.gpt import GPT, GPTConfig

        return GPT(
            GPTConfig(
                vocab=vocab,
                context=spec.context,
                layers=spec.layers,
                heads=spec.heads,
                width=spec.width,
            )
        )
    import transformers

    if spec.family == "qwen3_moe":
        moe: Any = transformers.Qwen3MoeConfig(
            hidden_size=spec.width,
            intermediate_size=spec.expert_width,  # no dense MLP: every block is an MoE block
            moe_intermediate_size=spec.expert_width,
            num_experts=spec.experts,
            num_experts_per_tok=spec.topk,
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.heads,
            head_dim=spec.width // spec.heads,
            vocab_size=vocab,
            max_position_embeddings=spec.context,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=False,
            use_cache=False,
        )
        # the loss is the next-token cross-entropy alone (no load-balancing term), the same
        # for every recipe
        return transformers.Qwen3MoeForCausalLM(moe)
    config: Any = transformers.LlamaConfig(
        hidden_size=spec.width,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        vocab_size=vocab,
        max_position_embeddings=spec.context,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,  # the head is a linear layer a recipe may keep in BF16
        use_cache=False,  # training: no key/value cache to build and keep
    )
    return transformers.LlamaForCausalLM(config)


def model_loss(model: nn.Module, spec: ModelSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of predicting ``y`` from ``x``, the same for both families
    (transformers' own ``labels=`` would shift the labels itself and drop a position)."""
    if spec.family == "gpt":
        return model(x, y)
    import torch.nn.functional as F

    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
