"""The host side of a rowwise quantize module (``templates/quantize.py.j2``): compiling its
kernels against fake tensors, checking the input, allocating the outputs and listing the
launches. The generated module builds one ``RowwiseHost`` from its spec's ``RowwiseParams`` and
its kernel classes, and binds ``compile_kernel``, ``check_input``, ``launches`` and ``run`` to it
(the module contract of ``fp4gen.codegen.quantize``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint8

from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import RHTSpec
from fp4gen.kernels import host
from fp4gen.kernels.quantize import SIGN_WORDS, RowwiseParams
from fp4gen.numerics.hadamard import rht_signs
from fp4gen.vocab import DTYPES


@dataclass(frozen=True, eq=False)
class RowwiseHost:
    """Compile, check and launch the kernels of one rowwise spec."""

    spec_name: str
    kernels: tuple[str, ...]  # kernel names in launch order: ("amax",) "quantize"
    archs: tuple[str, ...]
    params: RowwiseParams
    k_multiple: int  # K must be a multiple of this
    k_rule: str  # why (the error says it)
    # kernel name -> the module's kernel class (its name is the kernel symbol's), built per arch
    entries: Mapping[str, Callable[[str], object]] = field(default_factory=dict)

    @property
    def input_torch(self) -> torch.dtype:
        return getattr(torch, DTYPES[self.params.input_dtype].torch_name)

    @property
    def scale_torch(self) -> torch.dtype:
        return torch.float32 if self.params.scale.kind == "fp32" else torch.uint8

    @property
    def stochastic(self) -> bool:
        """The kernel draws Philox words (stochastic elements or block scales): it takes the
        seed and the offset."""
        return self.params.philox

    def compile_kernel(self, name: str, arch: str, *, dump_dir: str | None = None):
        """The TVM-FFI compiled callable of kernel ``name`` for ``arch`` ("sm_90a" or
        "sm_100a"), built against fake tensors with dynamic M and K (K % k_multiple == 0);
        needs no GPU. With ``dump_dir`` (created if missing) the PTX is kept there (else
        keep-ptx writes into the current directory)."""
        p = self.params
        options = host.compile_options(
            self.spec_name, self.kernels, self.archs, name, arch, dump_dir
        )
        fake = cute.runtime.make_fake_compact_tensor
        m = cute.sym_int()
        x = fake(
            p.input_type,
            (m, cute.sym_int(divisibility=self.k_multiple)),
            stride_order=(1, 0),
            assumed_align=16,
        )
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        signs = [Int32(0)] * SIGN_WORDS if p.rht_runtime_signs else []
        # the global amax and S_dec: one, or one per row
        scalars = (m,) if p.global_rows else (1,)
        if p.global_scale and name == "amax":
            amax = fake(Float32, scalars, assumed_align=4)
            return cute.compile(
                self.entries["amax"](arch), x, amax, *signs, stream, options=options
            )
        scale_t = Float32 if p.scale.kind == "fp32" else Uint8
        args = [
            x,
            fake(
                Uint8,
                (m, cute.sym_int(divisibility=self.k_multiple * p.elem.bits // 8)),
                stride_order=(1, 0),
                assumed_align=16,
            ),
            fake(scale_t, (m, cute.sym_int()), stride_order=(1, 0), assumed_align=4),
        ]
        if p.swizzled:
            args.append(fake(Uint8, (cute.sym_int(),), assumed_align=16))
        args.append(fake(Float32, scalars, assumed_align=4))  # the global amax or S_dec
        if p.global_scale:
            args.append(fake(Float32, scalars, assumed_align=4))  # S_dec
        if self.stochastic:
            args += [Int32(0)] * 8  # seed, offset, counter address, stride: (lo, hi) each
        args += signs  # the RHT's sign words, where they are arguments
        return cute.compile(self.entries["quantize"](arch), *args, stream, options=options)

    def check_input(self, x: object) -> None:
        """Raise TensorError unless x is what the kernels take: a CUDA, contiguous, 16-byte
        aligned 2-D tensor of the spec's input dtype [M, K], K % k_multiple == 0,
        0 < M * K < 2^31."""
        host.check_input_2d(
            self.spec_name,
            x,
            dtype=self.input_torch,
            k_multiple=self.k_multiple,
            k_rule=self.k_rule,
            rows="M",
        )

    def offset_args(self, offset: int | DeviceOffset, x: torch.Tensor) -> list[int]:
        """The kernel's Philox offset scalars (offset, counter address, stride; (lo, hi) each)
        of an int offset (address 0: the kernel reads nothing) or a DeviceOffset (one slot;
        the kernel reads its counter)."""
        return host.offset_words(self.spec_name, offset, x)

    def sign_args(self, signs: RHTSpec | None) -> list[int]:
        """The kernels' sign-word arguments: none unless the RHT's signs are arguments; then
        those of ``signs``, the transform with its layer's (and step's) stream."""
        if not self.params.rht_runtime_signs:
            if signs is not None:
                raise ValueError(f"{self.spec_name}: the RHT's signs are compiled in")
            return []
        if signs is None or not signs.redrawn or signs.size != self.params.rht_size:
            raise ValueError(
                f"{self.spec_name}: the RHT of size {self.params.rht_size} draws its signs per "
                f"layer or step: pass signs=RHTSpec.at(layer, step), got {signs!r}"
            )
        if self.params.sign_masks:
            return list(rht_sign_masks(signs))
        return list(rht_sign_words(signs))

    def launches(
        self,
        x: torch.Tensor,
        *,
        seed: int = 0,
        offset: int | DeviceOffset = 0,
        signs: RHTSpec | None = None,
    ) -> tuple[dict[str, torch.Tensor], list[tuple[str, tuple]]]:
        """Validate x and allocate the outputs: returns (outputs, [(kernel name, arguments)] in
        launch order). ``run`` launches them; a benchmark can time each launch on its own.
        ``signs``: with runtime RHT signs, the transform resolved for this call
        (``RHTSpec.at(layer, step)``)."""
        p = self.params
        self.check_input(x)
        sign_args = self.sign_args(signs)
        host.check_u64("seed", seed)
        if self.stochastic:
            offset_args = self.offset_args(offset, x)
        else:
            host.check_offset(offset)
        M, K = x.shape
        dev = x.device
        data = torch.empty((M, K * p.elem.bits // 8), dtype=torch.uint8, device=dev)
        scales = torch.empty((M, K // p.block), dtype=self.scale_torch, device=dev)
        out = {"data": data, "scales": scales}
        plan: list[tuple[str, tuple]] = []
        args: list[object] = [x, data, scales]
        if p.swizzled:
            swizzled = torch.zeros(
                host.swizzled_bytes(M, K // p.block), dtype=torch.uint8, device=dev
            )
            args.append(swizzled)
        if p.global_scale:
            rows = M if p.global_rows else 1  # one global scale per row, or per tensor
            amax = torch.zeros(rows, dtype=torch.float32, device=dev)
            s_dec = torch.empty(rows, dtype=torch.float32, device=dev)
            plan.append(("amax", (x, amax, *sign_args)))
            args += [amax, s_dec]
        else:
            # S_dec = 1 (no global scale), written here: the kernel stores NaN over it for an
            # input with a NaN or an Inf, and only then
            s_dec = torch.ones(1, dtype=torch.float32, device=dev)
            args.append(s_dec)
        out["global_scale"] = s_dec.reshape(M, 1) if p.global_rows else s_dec.reshape(())
        if self.stochastic:
            args += [*host.u64_words(seed), *offset_args]
        args += sign_args
        plan.append(("quantize", tuple(args)))
        if p.swizzled:
            out["scales_swizzled"] = swizzled
        return out, plan

    def run(
        self,
        fns: Mapping[str, Callable],
        x: torch.Tensor,
        *,
        seed: int = 0,
        offset: int | DeviceOffset = 0,
        signs: RHTSpec | None = None,
    ) -> dict[str, torch.Tensor]:
        """Quantize x with the compiled kernels ``fns`` (name -> callable, see KERNELS).

        Returns {"data": packed codes uint8 [M, K*ELEM_BITS/8], "scales": [M, K/BLOCK] scale
        codes (uint8; fp32 values for fp32 scales), "global_scale": fp32 0-dim S_dec} and, for
        the swizzled layout, "scales_swizzled": uint8 128x4 tensor-core layout. ``seed`` /
        ``offset`` select the Philox stream of stochastic rounding (unused otherwise); the
        offset is an int or a DeviceOffset (read by the kernel from device memory, see
        fp4gen.device_offset). S_dec is NaN iff x held a NaN or an Inf
        (NONFINITE_TO_NAN_SCALE). Raises TensorError for an input the kernels cannot take.
        """
        out, plan = self.launches(x, seed=seed, offset=offset, signs=signs)
        for name, args in plan:
            fns[name](*args)
        return out


@lru_cache(maxsize=4096)
def rht_sign_words(rht: RHTSpec) -> tuple[int, ...]:
    """The RHT's signs as the kernels take them: SIGN_WORDS Int32 values, bit i % 32 of word
    i // 32 set where position i is -1 (``fp4gen.numerics.hadamard.rht_signs``: the
    reference's draw, so kernel and reference flip the same positions). Kept per transform:
    one draw per layer and step."""
    negative = (rht_signs(rht) < 0).tolist()
    words = [0] * SIGN_WORDS
    for i, neg in enumerate(negative):
        if neg:
            words[i // 32] |= 1 << (i % 32)
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)  # as Int32


@lru_cache(maxsize=4096)
def rht_sign_masks(rht: RHTSpec) -> tuple[int, ...]:
    """The RHT's signs as the kernels with ``RowwiseParams.sign_masks`` take them: SIGN_WORDS
    Int32 values, mask k holding bit 15 where position 2k is -1 and bit 31 where position
    2k + 1 is (the sign bits of a packed pair of 16-bit values), zeros past size / 2; the
    same draw as ``rht_sign_words``."""
    negative = (rht_signs(rht) < 0).tolist()
    if len(negative) > 2 * SIGN_WORDS:
        raise ValueError(f"an RHT of {len(negative)} points has more pair masks than {SIGN_WORDS}")
    masks = [0] * SIGN_WORDS
    for i, neg in enumerate(negative):
        if neg:
            masks[i // 2] |= 1 << (15 + 16 * (i % 2))
    return tuple(m - (1 << 32) if m >= 1 << 31 else m for m in masks)  # as Int32


__all__ = ["RowwiseHost", "rht_sign_masks", "rht_sign_words"]
