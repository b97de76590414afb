"""Multi-head attention whose projections are linear layers convert can replace.

``torch.nn.MultiheadAttention`` holds its input projection as one parameter (``in_proj_weight``
[3E, E]) and calls ``F.multi_head_attention_forward``, which reads that parameter and
``out_proj.weight`` itself: replacing ``out_proj`` by another module would change nothing it
computes. ``MultiheadAttention`` here computes the same attention with both projections as
``nn.Linear`` children (``in_proj`` [3E, E] and ``out_proj`` [E, E], holding the original
parameters, no copy), so ``fp4gen.convert`` plans and replaces them as it does every linear
layer (layer rules, show_plan, the layer graphs, FSDP2, export).

What stays as it was: the attention math (the scaled dot product of torch's own, with the same
masks, dropout, ``need_weights`` / ``average_attn_weights`` and ``is_causal`` rules), the
module's attributes (``embed_dim``, ``num_heads``, ``batch_first``, ``in_proj_weight``, ...)
and its ``state_dict`` keys (``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``,
``out_proj.bias``), so checkpoints of the original model load into the converted one and back.
``named_parameters()`` names the input projection's parameters ``in_proj.weight`` / ``.bias``.

Served: a self- or cross-attention module whose query, key and value share the embedding size
(one packed ``in_proj_weight``), without ``add_bias_kv`` or ``add_zero_attn``
(``unsupported_reason`` says why another is left as it is; convert reports it). For
cross-attention (query other than key) the input projection runs on each distinct input and
keeps its part of the output (q from the query's, k and v from the key's and value's): the
same quantized weight for every part, at up to three times the projection's work (logged
once).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp4gen.runtime.loader import LogOnce

log = logging.getLogger("fp4gen.runtime")
_log_once = LogOnce(log)


def unsupported_reason(module: nn.MultiheadAttention) -> str | None:
    """Why ``MultiheadAttention.from_torch`` does not take ``module``, or None."""
    if not module._qkv_same_embed_dim:
        return (
            f"kdim {module.kdim} / vdim {module.vdim} differ from embed_dim {module.embed_dim}: "
            "separate q, k and v weights"
        )
    if module.bias_k is not None or module.bias_v is not None:
        return "add_bias_kv (bias_k and bias_v)"
    if module.add_zero_attn:
        return "add_zero_attn"
    return None


def _each(
    fn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn`` of each input, keeping which of them are one tensor (self-attention's test)."""
    q = fn(query)
    k = q if key is query else fn(key)
    v = k if value is key else fn(value)
    return q, k, v


def _float_mask(mask: torch.Tensor | None, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: not attended) as an additive float mask of ``dtype`` (-inf where
    True), a float mask as it is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name}: only bool and floating masks are supported, got {mask.dtype}")
    return mask


class MultiheadAttention(nn.Module):
    """``nn.MultiheadAttention``'s computation with ``in_proj`` and ``out_proj`` as linear
    layers (module docstring). Build it from a module with ``from_torch``."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = False,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim = self.kdim = self.vdim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        # what code reading an nn.MultiheadAttention's attributes checks
        self._qkv_same_embed_dim = True
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        kw = {"device": device, "dtype": dtype}
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        if self.in_proj.weight.device.type != "meta":  # nn.MultiheadAttention's initial values
            nn.init.xavier_uniform_(self.in_proj.weight)
            if bias:
                nn.init.zeros_(self.in_proj.bias)
                nn.init.zeros_(self.out_proj.bias)
        self.register_state_dict_post_hook(_torch_keys)
        self.register_load_state_dict_pre_hook(_own_keys)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiheadAttention:
        """The same attention as ``module``, holding its parameters (no copy) and its training
        mode. ValueError where ``unsupported_reason`` gives a reason."""
        reason = unsupported_reason(module)
        if reason is not None:
            raise ValueError(f"MultiheadAttention.from_torch does not take this module: {reason}")
        bias = module.in_proj_bias is not None
        new = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=bias,
            batch_first=module.batch_first,
            device="meta",
        )
        new.in_proj.weight = module.in_proj_weight
        new.out_proj.weight = module.out_proj.weight
        if bias:
            new.in_proj.bias = module.in_proj_bias
            new.out_proj.bias = module.out_proj.bias
        return new.train(module.training)

    @property
    def in_proj_weight(self) -> torch.Tensor:
        return self.in_proj.weight

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        return self.in_proj.bias

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}"
        )

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [L or S, N, E]: one in_proj call per distinct input, each keeping its part."""
        e = self.embed_dim
        qkv = self.in_proj(query)
        if key is query and value is query:
            return qkv[..., :e], qkv[..., e : 2 * e], qkv[..., 2 * e :]
        _log_once(
            "fp4gen MultiheadAttention: cross-attention runs the packed input projection on "
            "each distinct input and keeps its part (up to three times the projection's work)"
        )
        kv = self.in_proj(key)
        v = kv if value is key else self.in_proj(value)
        return qkv[..., :e], kv[..., e : 2 * e], v[..., 2 * e :]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(attn_output, attn_weights) as ``nn.MultiheadAttention.forward`` returns them."""
        batched = query.dim() == 3
        if self.batch_first and batched:  # to [L, N, E]
            query, key, value = _each(lambda t: t.transpose(0, 1), query, key, value)
        if not batched:
            query, key, value = _each(lambda t: t.unsqueeze(1), query, key, value)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape
        if embed_dim != self.embed_dim:
            raise ValueError(f"query of embedding size {embed_dim}; expected {self.embed_dim}")
        if key.shape != value.shape:
            raise ValueError(f"key of shape {tuple(key.shape)}, value {tuple(value.shape)}")
        heads, head_dim = self.num_heads, self.head_dim
        key_padding_mask = _float_mask(key_padding_mask, "key_padding_mask", query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal needs attn_mask (the causal mask it stands for)")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # the scaled dot product applies the causal mask itself
        else:
            attn_mask = _float_mask(attn_mask, "attn_mask", query.dtype)
            if key_padding_mask is not None:
                is_causal = False  # the merged mask is no longer causal
        q, k, v = self._project(query, key, value)
        src_len = k.shape[0]
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if attn_mask.shape != (tgt_len, src_len):
                    raise RuntimeError(
                        f"attn_mask of shape {tuple(attn_mask.shape)}; expected "
                        f"{(tgt_len, src_len)}"
                    )
                attn_mask = attn_mask.unsqueeze(0)
            elif attn_mask.dim() != 3 or attn_mask.shape != (bsz * heads, tgt_len, src_len):
                raise RuntimeError(
                    f"attn_mask of shape {tuple(attn_mask.shape)}; expected {(tgt_len, src_len)} "
                    f"or {(bsz * heads, tgt_len, src_len)}"
                )
        # [N * H, L, head_dim]: batch and heads first
        q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.reshape(src_len, bsz * heads, head_dim).transpose(0, 1)
        v = v.reshape(src_len, bsz * heads, head_dim).transpose(0, 1)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (bsz, src_len):
                raise RuntimeError(
                    f"key_padding_mask of shape {tuple(key_padding_mask.shape)}; expected "
                    f"{(bsz, src_len)}"
                )
            merged = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1)
            merged = merged.reshape(bsz * heads, 1, src_len)
            attn_mask = merged if attn_mask is None else attn_mask + merged
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            scores = q * math.sqrt(1.0 / float(head_dim))
            if attn_mask is not None:
                scores = torch.baddbmm(attn_mask, scores, k.transpose(-2, -1))
            else:
                scores = torch.bmm(scores, k.transpose(-2, -1))
            weights = F.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = torch.bmm(weights, v).transpose(0, 1).contiguous().view(tgt_len * bsz, embed_dim)
            out = self.out_proj(out).view(tgt_len, bsz, -1)
            weights = weights.view(bsz, heads, tgt_len, src_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                out, weights = out.squeeze(1), weights.squeeze(0)
        else:
            if attn_mask is not None:
                if attn_mask.size(0) == 1:
                    attn_mask = attn_mask.unsqueeze(0)
                else:
                    attn_mask = attn_mask.view(bsz, heads, -1, src_len)
            q = q.view(bsz, heads, tgt_len, head_dim)
            k = k.view(bsz, heads, src_len, head_dim)
            v = v.view(bsz, heads, src_len, head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
            out = out.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, embed_dim)
            out = self.out_proj(out).view(tgt_len, bsz, -1)
            weights = None
            if not batched:
                out = out.squeeze(1)
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        return out, weights


# The state_dict keeps nn.MultiheadAttention's keys: in_proj.weight / .bias are stored as
# in_proj_weight / in_proj_bias, and read back from either name.
_RENAMED = (("in_proj.weight", "in_proj_weight"), ("in_proj.bias", "in_proj_bias"))


def _torch_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for ours, torchs in _RENAMED:
        if prefix + ours in state_dict:
            state_dict[prefix + torchs] = state_dict.pop(prefix + ours)


def _own_keys(
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    for ours, torchs in _RENAMED:
        if prefix + torchs in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + torchs)


def module_keys(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s state_dict) with every ``MultiheadAttention``'s input projection
    under its module's name (``in_proj.weight`` / ``.bias``, not ``in_proj_weight``), in order:
    what an export writing each linear layer under its name reads."""
    renamed: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, MultiheadAttention):
            prefix = f"{name}." if name else ""
            for ours, torchs in _RENAMED:
                renamed[prefix + torchs] = prefix + ours
    if not renamed:
        return state
    return {renamed.get(key, key): value for key, value in state.items()}


__all__ = ["MultiheadAttention", "module_keys", "unsupported_reason"]
