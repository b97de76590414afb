"""Philox4x32-10 against Random123's known-answer vectors and a scalar Python implementation."""

from __future__ import annotations

import math

import pytest
import torch

from fp4gen.numerics.philox import philox4x32, random_bits, random_words

M32 = 0xFFFFFFFF


def scalar_philox(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> list[int]:
    """Philox4x32-10 on Python ints, written from the Random123 description."""
    c = list(ctr)
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & M32, (p0 >> 32) ^ c[3] ^ k1, p0 & M32]
    return c


def scalar_word(i: int, seed: int, offset: int) -> int:
    q = i // 4
    ctr = (q & M32, q >> 32, offset & M32, offset >> 32)
    return scalar_philox(ctr, (seed & M32, seed >> 32))[i % 4]


KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_known_answers(ctr, key, want) -> None:
    counter = tuple(torch.tensor([w], dtype=torch.int64) for w in ctr)
    got = tuple(int(w) for w in philox4x32(counter, key))  # type: ignore[arg-type]
    assert got == want
    assert tuple(scalar_philox(ctr, key)) == want


def test_vectorized_equals_scalar_on_random_counters() -> None:
    gen = torch.Generator().manual_seed(0)
    ctr = [torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64) for _ in range(4)]
    key = (0x12345678, 0x9ABCDEF0)
    got = torch.stack(philox4x32(tuple(ctr), key), 1).tolist()  # type: ignore[arg-type]
    for j in range(64):
        assert got[j] == scalar_philox(tuple(int(c[j]) for c in ctr), key)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "seed,offset",
    [(0, 0), (1, 0), (42, 7), (2**64 - 1, 2**64 - 1), (0xDEADBEEF12345678, 2**32 + 5)],
)
def test_random_bits_layout(seed: int, offset: int) -> None:
    n = 37  # not a multiple of 4: the last counter is used in part
    got = random_bits(n, seed, offset).tolist()
    assert got == [scalar_word(i, seed, offset) for i in range(n)]


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("seed,offset", [(0, 0), (42, 7), (2**64 - 1, 2**32 + 5)])
def test_random_fields_layout(seed: int, offset: int, bits: int) -> None:
    # element i takes field i % v (low bits first) of word i // v, v = 32 / bits fields a word
    v = 32 // bits
    n = 16 * v + 3  # ends inside a word and inside a Philox call
    got = random_bits(n, seed, offset, bits=bits).tolist()
    mask = 2**bits - 1
    want = [(scalar_word(i // v, seed, offset) >> (bits * (i % v))) & mask for i in range(n)]
    assert got == want


def test_random_fields_bad_width() -> None:
    with pytest.raises(ValueError, match="bits must be 8, 16 or 32"):
        random_bits(4, 0, bits=4)


def test_random_words_high_counter_words() -> None:
    # Indices beyond 2^34 reach the counter's second word (q >> 32); the largest index too.
    idx = [0, 5, (5 << 34) + 6, (1 << 40) + 3, 2**63 - 1]
    got = random_words(torch.tensor(idx, dtype=torch.int64), 9, 2**40 + 3).tolist()
    assert got == [scalar_word(i, 9, 2**40 + 3) for i in idx]
    assert torch.equal(random_words(torch.arange(37), 77, 1), random_bits(37, 77, 1))


def test_random_bits_properties() -> None:
    bits = random_bits(1 << 16, seed=123)
    assert bits.dtype == torch.int64
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**32
    # Each bit position is set about half the time (binomial sd = 128 at n = 65536; 6 sd slack).
    for b in range(32):
        ones = int(((bits >> b) & 1).sum())
        assert abs(ones - 32768) < 6 * 128, b
    assert not torch.equal(random_bits(64, 123, offset=1), random_bits(64, 123, offset=0))
    assert torch.equal(random_bits(64, 123, 5), random_bits(64, 123, 5))


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5])
def test_bad_seed(bad) -> None:
    with pytest.raises(ValueError, match="seed must be an integer"):
        random_bits(4, bad)
    with pytest.raises(ValueError, match="offset must be an integer"):
        random_bits(4, 0, bad)


@pytest.mark.parametrize("bits", [32, 16, 8])
@pytest.mark.parametrize("n", [8, 12, 16, 24, 32, 40, 48, 64, 96])
def test_kernel_field_runs_follow_the_reference_layout(
    monkeypatch: pytest.MonkeyPatch, bits: int, n: int
) -> None:
    """The device helpers pick element i's field i % v of word i // v for every run of n
    elements from a multiple of n, including runs that cross Philox calls unevenly (a 1x24
    block with 8-bit fields: 24 elements over calls of 16; it failed to compile before).
    The helpers are traced Python, so plain ints stand in for the DSL's Uint32 here, and a
    stand-in Philox returns words that name their call and slot."""
    from fp4gen.kernels import philox as device

    monkeypatch.setattr(device, "Uint32", lambda v: int(v) & 0xFFFFFFFF)
    monkeypatch.setattr(device, "byte_field", lambda w, k: (w >> (8 * k)) & 0xFF, raising=False)
    monkeypatch.setattr(device.cutlass, "select_", lambda c, a, b: a if c else b)
    monkeypatch.setattr(
        device, "philox4x32_10", lambda c0, c1, lo, hi, keys: [c0 * 4 + j for j in range(4)]
    )

    per_word = 32 // bits
    per_call = 4 * per_word

    def want(i: int) -> int:  # field i % v of word i // v, low bits first
        word = i // per_word
        return (word >> (bits * (i % per_word))) & ((1 << bits) - 1) if bits < 32 else word

    for i0 in range(0, 6 * max(n, per_call), n):
        got = device.random_fields(i0, n, bits, [], 0, 0)
        assert got == [want(i) for i in range(i0, i0 + n)], (i0, n, bits)
        if n % per_word == 0 and math.gcd(n, per_call) % per_word == 0:  # runs of whole words
            words = device.random_words(i0, n, bits, [], 0, 0)
            assert words == [i // per_word for i in range(i0, i0 + n, per_word)]
