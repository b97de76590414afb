"""Philox4x32-10 (Random123), vectorized in torch with int64 arithmetic (CPU and CUDA).

fp4gen's definition of the random word of an element (kernels must draw the same bits):

* ``i`` is the element's linear index in the tensor being quantized, row-major in the
  orientation being quantized (for a columnwise copy: the index in the transposed tensor).
* key     = (seed & 0xffffffff, seed >> 32)                      (seed: 0 <= seed < 2^64)
* counter = (q & 0xffffffff, q >> 32, offset & 0xffffffff, offset >> 32),  q = i // 4
                                                                 (offset: 0 <= offset < 2^64)
* the element's word is output word ``i % 4`` of Philox4x32-10(counter, key).

So one Philox call feeds four consecutive elements, and ``offset`` (e.g. the training step)
selects an independent stream for the same seed.

Philox4x32 round (Random123): with (hi0, lo0) = mulhilo(0xD2511F53, c0) and
(hi1, lo1) = mulhilo(0xCD9E8D57, c2), the new counter is (hi1^c1^k0, lo1, hi0^c3^k1, lo0);
between rounds the key is bumped by the Weyl constants (0x9E3779B9, 0xBB67AE85). Ten rounds.
"""

from __future__ import annotations

import torch

from fp4gen.errors import ArgumentError

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
ROUNDS = 10


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product a * m, for uint32 a held in int64.

    The full product does not fit a signed int64, so a is split into 16-bit halves; every
    partial product stays below 2^49.
    """
    p_lo = (a & _MASK16) * m  # < 2^48
    p_hi = (a >> 16) * m  # < 2^48; the product is p_hi * 2^16 + p_lo
    s = p_lo + ((p_hi & _MASK16) << 16)  # < 2^49
    return (p_hi >> 16) + (s >> 32), s & _MASK32


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[int, int],
    rounds: int = ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-R on broadcastable int64 tensors of uint32 words; key words are Python ints."""
    c0, c1, c2, c3 = counter
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for r in range(rounds):
        if r > 0:
            k0 = (k0 + PHILOX_W0) & _MASK32
            k1 = (k1 + PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _check_u64(name: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise ArgumentError(f"{name} must be an integer in [0, 2^64), got {value!r}")


def random_words(index: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    """The 32-bit words of the elements with linear indices ``index`` (int64, any shape, values
    in [0, 2^64)); returns an int64 tensor of uint32 values of the same shape."""
    _check_u64("seed", seed)
    _check_u64("offset", offset)
    index = index.to(torch.int64)
    q = index >> 2  # i // 4 for non-negative i
    off_lo = torch.full_like(q, offset & _MASK32)
    off_hi = torch.full_like(q, offset >> 32)
    words = torch.stack(
        philox4x32((q & _MASK32, q >> 32, off_lo, off_hi), (seed & _MASK32, seed >> 32)), dim=-1
    )
    return torch.gather(words, -1, (index & 3).unsqueeze(-1)).squeeze(-1)


def random_bits(
    n: int,
    seed: int,
    offset: int = 0,
    device: torch.device | str | None = None,
    bits: int = 32,
) -> torch.Tensor:
    """The random fields of elements 0..n-1 (int64 tensor of values in [0, 2^bits), shape [n]).

    ``bits`` = 32: element i takes word i % 4 of Philox call i // 4. ``bits`` = 16 or 8: a word
    holds v = 32 / bits fields, low bits first; element i takes field i % v of word i // v, so
    one Philox call serves 4 v consecutive elements (docs/numerics.md section 5).
    """
    _check_u64("seed", seed)
    _check_u64("offset", offset)
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if bits not in (8, 16, 32):
        raise ValueError(f"bits must be 8, 16 or 32, got {bits!r}")
    per_word = 32 // bits
    n_words = -(-n // per_word)
    # One Philox call per 4 consecutive words (cheaper than random_words on arange(n)).
    q = torch.arange((n_words + 3) // 4, dtype=torch.int64, device=device)
    off_lo = torch.full_like(q, offset & _MASK32)
    off_hi = torch.full_like(q, offset >> 32)
    words = philox4x32((q & _MASK32, q >> 32, off_lo, off_hi), (seed & _MASK32, seed >> 32))
    words = torch.stack(words, dim=1).reshape(-1)[:n_words]
    if per_word == 1:
        return words
    shifts = torch.arange(per_word, dtype=torch.int64, device=words.device) * bits
    fields = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(-1)[:n]
