"""Host-side helpers every generated kernel module shares: the checks and PTX options that open
``compile_kernel``, the description of a tensor in an error, the checks of a kernel's input,
the 64-bit scalars a kernel takes as two int32 words, and the size of the 128x4 swizzled scale
layout.

Plain Python and torch, no device code: a generated module's ``compile_kernel``, ``launches`` and
``run`` are methods of a host object (``fp4gen.kernels.quantize_host``,
``fp4gen.kernels.mor_host``, ``fp4gen.kernels.gemm_sm90_host``) built from these pieces.
"""

from __future__ import annotations

import itertools
import os
import shlex
from collections.abc import Sequence

import numpy as np
import torch

from fp4gen.device_offset import DeviceOffset
from fp4gen.errors import TensorError


def compile_options(
    spec_name: str,
    kernels: tuple[str, ...],
    archs: tuple[str, ...],
    name: str,
    arch: str,
    dump_dir: str | None,
    *,
    arch_note: str = "",
) -> str:
    """The ``cute.compile`` options of kernel ``name`` for ``arch``, after checking both: TVM-FFI,
    the arch, and with ``dump_dir`` (created if missing) keep-PTX into it. ``arch_note`` follows
    the list of arches in the error (why only those)."""
    if name not in kernels:
        raise ValueError(f"{spec_name} has no kernel {name!r}; kernels: {kernels}")
    if arch not in archs:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {archs}{arch_note}")
    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir {shlex.quote(os.fspath(dump_dir))}"
    return options


def describe(t: object) -> str:
    """A tensor as an error message names it: shape, dtype, device (else the type's name)."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_input_2d(
    spec_name: str,
    x: object,
    *,
    dtype: torch.dtype,
    k_multiple: int,
    k_rule: str,
    rows: str,
    m_multiple: int = 1,
    m_rule: str = "",
) -> None:
    """Raise TensorError unless ``x`` is what a quantize or MoR kernel takes: a CUDA, contiguous,
    16-byte aligned 2-D ``dtype`` tensor [rows, K], K % k_multiple == 0 (``k_rule`` says why),
    rows % m_multiple == 0 (``m_rule`` says why), 0 < rows * K < 2^31. ``rows`` names the first
    dimension ("M", "R") in the messages."""
    if not isinstance(x, torch.Tensor):
        raise TensorError(f"{spec_name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise TensorError(f"{spec_name}: the input must be 2-D [{rows}, K]; got {describe(x)}")
    if x.dtype != dtype:
        raise TensorError(f"{spec_name}: the input must be {dtype}; got {describe(x)}")
    if x.shape[1] % k_multiple:
        raise TensorError(
            f"{spec_name}: K must be a multiple of {k_multiple} ({k_rule}); got {describe(x)}"
        )
    if x.shape[0] % m_multiple:
        raise TensorError(
            f"{spec_name}: {rows} must be a multiple of {m_multiple} ({m_rule}); got {describe(x)}"
        )
    if x.numel() == 0:
        raise TensorError(f"{spec_name}: cannot quantize an empty tensor; got {describe(x)}")
    if x.numel() >= 2**31:
        raise TensorError(f"{spec_name}: {rows} * K must be below 2^31; got {describe(x)}")
    if not x.is_contiguous():
        raise TensorError(f"{spec_name}: the input must be contiguous; got {describe(x)}")
    if x.device.type != "cuda":
        raise TensorError(f"{spec_name}: the input must be on a CUDA device; got {describe(x)}")
    if x.data_ptr() % 16:
        raise TensorError(f"{spec_name}: the input must be 16-byte aligned; got {describe(x)}")


def check_u64(name: str, value: object) -> None:
    """Raise ValueError unless ``value`` is an int in [0, 2^64) (a seed, a Philox offset)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise ValueError(f"{name} must be an integer in [0, 2^64), got {value!r}")


def i32(word: int) -> int:
    """A uint32 word as the int32 with the same bits (kernel scalars are Int32)."""
    return word - (1 << 32) if word >= 1 << 31 else word


def u64_words(value: int) -> list[int]:
    """A uint64 as the kernel's two Int32 scalars (low word, high word)."""
    return [i32(value & 0xFFFFFFFF), i32(value >> 32)]


def u64_table(rows: Sequence[Sequence[int]], names: list[str]) -> np.ndarray:
    """Rows of uint64 values (seeds, Philox offsets; ``names[j]`` says what column j holds) as
    the kernels' int32 words: each value its (low word, high word) pair, as ``u64_words``, an
    int32 array [rows, 2 x columns]. ValueError unless every value is an int in [0, 2^64), as
    ``check_u64`` says. One numpy pass for a launch's table (a grouped launch has one row per
    group: per-value calls were a measurable share of its host time)."""
    # the checks value by value only where a value may be wrong: plain ints (one type test of
    # every value at C speed) in [0, 2^64) in a table of the right shape pass without them
    values = None
    if set(map(type, itertools.chain.from_iterable(rows))) <= {int}:
        values = np.asarray(rows)
    if (
        values is None
        or values.dtype.kind not in "iu"
        or values.shape != (len(rows), len(names))
        or (values.dtype.kind == "i" and bool((values < 0).any()))
    ):
        for row in rows:
            for name, value in zip(names, row, strict=True):
                if type(value) is not int or not 0 <= value < 1 << 64:
                    check_u64(name, value)  # raises, naming the value
        # valid after all (values from 2^63 on mixed with others: numpy took floats)
        values = np.array(rows, dtype=np.uint64)
    values = values.astype(np.uint64).reshape(len(rows), len(names))
    low = (values & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    high = (values >> np.uint64(32)).astype(np.uint32)
    return np.stack((low, high), axis=-1).reshape(len(rows), 2 * len(names)).view(np.int32)


def offset_words(spec_name: str, offset: int | DeviceOffset, x: torch.Tensor) -> list[int]:
    """The Philox offset scalars of a one-output kernel (offset, counter address, stride; (lo,
    hi) each) of an int offset (address 0: the kernel reads nothing) or a DeviceOffset (one
    slot; the kernel reads its counter, which must be on x's device)."""
    if not isinstance(offset, DeviceOffset):
        check_u64("offset", offset)
        return [*u64_words(offset), 0, 0, 0, 0]
    if len(offset.slots) != 1:
        raise ValueError(f"{spec_name}: one output, one DeviceOffset slot; got {offset.slots}")
    if offset.counter.device != x.device:
        raise ValueError(
            f"{spec_name}: the DeviceOffset counter is on {offset.counter.device}, the input on "
            f"{x.device}"
        )
    words: list[int] = []
    for w in (offset.slots[0], offset.counter.data_ptr(), offset.stride):
        words += u64_words(w)
    return words


def check_offset(offset: object) -> None:
    """An int offset in [0, 2^64) or a DeviceOffset, for a kernel without stochastic rounding
    (which reads no offset)."""
    if not isinstance(offset, DeviceOffset):
        check_u64("offset", offset)


def swizzled_bytes(rows: int, cols: int) -> int:
    """Size of the 128x4 swizzled layout of a [rows, cols] scale matrix (padding included)."""
    return -(-rows // 128) * 128 * (-(-cols // 4) * 4)
