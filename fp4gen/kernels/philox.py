"""The random bits of stochastic rounding on the GPU: Philox4x32-10 and how an element finds its
field (docs/numerics.md 5; the reference is ``fp4gen.numerics.philox``).

Element i of a copy takes the ``bits``-bit field i % v (low bits first, v = 32 // bits fields per
word) of word i // v, and word j is output j % 4 of Philox(counter = (j // 4, 0, offset_lo,
offset_hi), key = seed). The offset is an int, or a device counter times a stride plus a slot
(``fp4gen.device_offset.DeviceOffset``), read by the kernel.

Plain Python functions: they run while a kernel is traced (loops unroll, indices are constants).
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Uint32, Uint64

from fp4gen.kernels.quant_ptx import byte_field, load_counter

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def philox_offset(ctr_lo, ctr_hi, stride_lo, stride_hi, off_lo, off_hi):
    """(lo, hi) words of the Philox offset: counter * stride + offset (mod 2^64), with the
    counter read from device memory (a DeviceOffset; its slot is the offset), or 0 for an int
    offset (address 0: the offset itself, bit for bit)."""
    count = load_counter(ctr_lo, ctr_hi)
    stride = (Uint64(Uint32(stride_hi)) << Uint64(32)) | Uint64(Uint32(stride_lo))
    base = (Uint64(Uint32(off_hi)) << Uint64(32)) | Uint64(Uint32(off_lo))
    offset = count * stride + base
    return Uint32(offset), Uint32(offset >> Uint64(32))


def philox_keys(seed_lo: Uint32, seed_hi: Uint32) -> list:
    """The 10 round keys of Philox4x32-10 (the key bumped by the Weyl constants)."""
    keys = [(seed_lo, seed_hi)]
    for _ in range(9):
        k0, k1 = keys[-1]
        keys.append((k0 + Uint32(PHILOX_W0), k1 + Uint32(PHILOX_W1)))
    return keys


def philox4x32_10(c0, c1, c2, c3, keys: list) -> list:
    """Philox4x32-10 (Random123): with (hi0, lo0) = mulhilo(M0, c0), (hi1, lo1) =
    mulhilo(M1, c2), a round maps c to (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)."""
    for k0, k1 in keys:
        p0 = Uint64(c0) * Uint64(PHILOX_M0)  # mul.wide.u32
        p1 = Uint64(c2) * Uint64(PHILOX_M1)
        hi0, lo0 = Uint32(p0 >> Uint64(32)), Uint32(p0)
        hi1, lo1 = Uint32(p1 >> Uint64(32)), Uint32(p1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def random_words(i0: Uint32, n: int, bits: int, keys: list, off_lo: Uint32, off_hi: Uint32) -> list:
    """The Philox words that hold the ``bits``-bit random fields (32, 16 or 8) of the n
    consecutive elements from flat index i0 (module docstring). Either the elements cover whole
    calls (n and i0 multiples of 4 v) or they sit inside one call (n divides 4 v, n >= v,
    i0 % n == 0)."""
    per_word = 32 // bits
    per_call = 4 * per_word
    if not _within_calls(n, per_call):
        if math.gcd(n, per_call) % per_word:
            raise ValueError(
                f"random_words: {n} elements of {bits}-bit fields from a multiple of {n} do not "
                "always start on a word boundary; use random_fields"
            )
        words = _spanning_calls(i0, n, per_call, keys, off_lo, off_hi)
        g = math.gcd(n, per_call)
        return _select_run(words, i0, n // per_word, per_call, g, g // per_word)
    if n >= per_call:
        q = i0 // Uint32(per_call)
        words = []
        for c in range(n // per_call):
            words += philox4x32_10(q + Uint32(c), Uint32(0), off_lo, off_hi, keys)
        return words
    call = philox4x32_10(i0 // Uint32(per_call), Uint32(0), off_lo, off_hi, keys)
    nw = n // per_word  # the words of part (i0 % per_call) // n of the call
    part = (i0 // Uint32(n)) % Uint32(per_call // n)
    return call_slice(call, part, nw)


def call_slice(call: list, part, nw: int) -> list:
    """Words part * nw .. part * nw + nw - 1 of a Philox call, for a runtime part."""
    words = call[:nw]
    for p in range(1, len(call) // nw):
        words = [cutlass.select_(part == Uint32(p), call[p * nw + w], words[w]) for w in range(nw)]
    return words


def random_fields(
    i0: Uint32, n: int, bits: int, keys: list, off_lo: Uint32, off_hi: Uint32
) -> list:
    """The ``bits``-bit random fields of the n consecutive elements from flat index i0, one per
    element (see random_words)."""
    per_call = 4 * (32 // bits)
    if not _within_calls(n, per_call):
        fields = fields_of(_spanning_calls(i0, n, per_call, keys, off_lo, off_hi), bits)
        g = math.gcd(n, per_call)
        return _select_run(fields, i0, n, per_call, g, g)
    return fields_of(random_words(i0, n, bits, keys, off_lo, off_hi), bits)


def _within_calls(n: int, per_call: int) -> bool:
    """Whether n elements from a multiple of n cover whole Philox calls or sit inside one."""
    return n % per_call == 0 or per_call % n == 0


def _spanning_calls(i0: Uint32, n: int, per_call: int, keys: list, off_lo, off_hi) -> list:
    """The words of every Philox call that n elements from i0 (a multiple of n) can touch: a run
    starts at a multiple of g = gcd(n, per_call) inside its first call, so it reaches into at
    most ceil((per_call - g + n) / per_call) calls (a block of 24 8-bit fields: 3 calls of 16)."""
    g = math.gcd(n, per_call)
    calls = -(-(per_call - g + n) // per_call)
    q = i0 // Uint32(per_call)
    words = []
    for c in range(calls):
        words += philox4x32_10(q + Uint32(c), Uint32(0), off_lo, off_hi, keys)
    return words


def _select_run(items: list, i0: Uint32, count: int, per_call: int, g: int, step: int) -> list:
    """``count`` consecutive items (fields, or words of ``step`` = g / v per place) of
    ``items`` from the run's start: i0 % per_call is a multiple of g, one of per_call / g
    places, picked at run time by selects."""
    place = (i0 % Uint32(per_call)) // Uint32(g)
    run = items[:count]
    for k in range(1, per_call // g):
        run = [
            cutlass.select_(place == Uint32(k), items[k * step + j], run[j]) for j in range(count)
        ]
    return run


def fields_of(words: list, bits: int) -> list:
    """The ``bits``-bit fields of Philox words, low bits first."""
    if bits == 16:
        return [f for w in words for f in (w & Uint32(0xFFFF), w >> Uint32(16))]
    if bits == 8:
        return [
            f
            for w in words
            for f in (w & Uint32(0xFF), byte_field(w, 1), byte_field(w, 2), w >> Uint32(24))
        ]
    return words


__all__ = [
    "call_slice",
    "fields_of",
    "philox4x32_10",
    "philox_keys",
    "philox_offset",
    "random_fields",
    "random_words",
]
