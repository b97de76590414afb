"""The Random Hadamard Transform's butterflies as the quantize kernels trace them
(docs/numerics.md section 4): on every chunk of ``size`` values, the signs, then butterflies
h = 1, 2, ..., size/2 in fp32, unscaled (the callers multiply by fp32(1/sqrt(d)) where their
order of operations puts it).

A plain Python function: it runs while a kernel is traced (loops unroll, indices and signs are
compile-time constants), so the rowwise and tile kernels that call it compile to what each
wrote inline before.
"""

from __future__ import annotations

from collections.abc import Sequence

from cutlass import Float32, Uint32


def signed_butterflies(xs: list, size: int, signs: Sequence[int]) -> list:
    """xs with each chunk of ``size`` values sign-flipped by ``signs`` and transformed by the
    unnormalized Walsh-Hadamard butterflies; a negative sign folds into the first add."""
    out = []
    for c in range(0, len(xs), size):
        out += butterflies([-xs[c + i] if signs[i] < 0 else xs[c + i] for i in range(size)], size)
    return out


def xor_signed_butterflies(xs: list, size: int, sign_bits: Sequence) -> list:
    """``signed_butterflies`` with signs known only when the kernel runs (drawn per layer or
    step, docs/numerics.md 12): ``sign_bits[i]`` is a Uint32 holding 0x80000000 for a -1 at
    position i, else 0, xored into the value's sign bit (exact, as the multiply by -1)."""
    out = []
    for c in range(0, len(xs), size):
        v = [(xs[c + i].bitcast(Uint32) ^ sign_bits[i]).bitcast(Float32) for i in range(size)]
        out += butterflies(v, size)
    return out


def butterflies(v: list, size: int) -> list:
    """The unnormalized Walsh-Hadamard butterflies h = 1, 2, ..., size/2 of one chunk."""
    v = list(v)
    h = 1
    while h < size:
        for j in range(size):
            if j % (2 * h) < h:
                v[j], v[j + h] = v[j] + v[j + h], v[j] - v[j + h]
        h *= 2
    return v
