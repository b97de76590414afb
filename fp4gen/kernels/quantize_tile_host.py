"""The host side of a tile quantize module (``templates/quantize_tile.py.j2``): compiling its
kernels against fake tensors, checking the input, allocating every copy's outputs and listing
the launches. The generated module builds one ``TileHost`` from its spec's
``TileQuantizeParams`` and its kernel classes, and binds ``compile_kernel``, ``check_input``,
``launches`` and ``run`` to it (the module contract of ``fp4gen.codegen.quantize``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint8

from fp4gen.device_offset import DeviceOffset
from fp4gen.kernels import host
from fp4gen.kernels.quantize_tile import TileQuantizeParams
from fp4gen.vocab import DTYPES

# run()'s keys of a copy's outputs: the rowwise copy's plain, the columnwise copy's prefixed
PREFIX = {"row": "", "col": "col_"}


@dataclass(frozen=True, eq=False)
class TileHost:
    """Compile, check and launch the kernels of one tile spec."""

    spec_name: str
    kernels: tuple[str, ...]  # kernel names in launch order: ("amax",) "quantize"
    archs: tuple[str, ...]
    params: TileQuantizeParams
    k_multiple: int  # K must be a multiple of this
    m_multiple: int  # M must be a multiple of this (the columnwise copy and its RHT)
    # kernel name -> the module's kernel class (its name is the kernel symbol's), built per arch
    entries: Mapping[str, Callable[[str], object]] = field(default_factory=dict)

    # ---- what the params say about the tensors
    @property
    def input_torch(self) -> torch.dtype:
        return getattr(torch, DTYPES[self.params.strip.input_dtype].torch_name)

    @property
    def scale_torch(self) -> torch.dtype:
        return torch.float32 if self.params.strip.fp32_scales else torch.uint8

    @property
    def tags(self) -> tuple[str, ...]:
        """The copies' tags in output order ("row", "col")."""
        return tuple(c.tag for c in self.params.copies)

    @property
    def slots(self) -> int:
        """Global amax slots: one per distinct transform of x (none, the column RHT)."""
        return 1 + max(c.slot for c in self.params.copies)

    @property
    def const_len(self) -> int:
        """Length of the prepared constants: a table per copy, then (k_enc, S_dec) of each."""
        return self.params.const_head + 2 * len(self.params.copies)

    @property
    def k_rule(self) -> str:
        """Why K must be a multiple of k_multiple (the error says it)."""
        p = self.params
        rule = f"{p.strip.vec}-value loads"
        if p.two_d:
            return rule + f", {p.block}x{p.block} tiles"
        if p.copy("row") is not None:
            return rule + f", 1x{p.block} row blocks"
        return rule

    @property
    def m_rule(self) -> str:
        return "the columnwise copy" + (" and its RHT" if self.m_multiple > 8 else "")

    # ---- compiling
    def compile_kernel(self, name: str, arch: str, *, dump_dir: str | None = None):
        """The TVM-FFI compiled callable of kernel ``name`` for ``arch`` ("sm_90a" or
        "sm_100a"), built against fake tensors with dynamic M and K (K % k_multiple == 0, M %
        m_multiple == 0); needs no GPU. With ``dump_dir`` (created if missing) the PTX is kept
        there (else keep-ptx writes into the current directory)."""
        p = self.params
        options = host.compile_options(
            self.spec_name, self.kernels, self.archs, name, arch, dump_dir
        )
        fake = cute.runtime.make_fake_compact_tensor
        m = cute.sym_int(divisibility=self.m_multiple)
        k = cute.sym_int(divisibility=self.k_multiple)
        x = fake(p.strip.input_type, (m, k), stride_order=(1, 0), assumed_align=16)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        scale_t = Float32 if p.strip.fp32_scales else Uint8
        one = consts = None
        if p.global_scale:
            one = [fake(Float32, (1,), assumed_align=4) for _ in range(self.slots)]
            if p.prep:
                consts = fake(Float32, (self.const_len,), assumed_align=16)
            if name == "amax":
                amax_args = [x, *one]
                if p.prep:
                    count = fake(Int32, (1,), assumed_align=4)
                    s_decs = [fake(Float32, (1,), assumed_align=4) for _ in p.copies]
                    amax_args += [count, consts, *s_decs]
                return cute.compile(self.entries["amax"](arch), *amax_args, stream, options=options)
        args = [x]
        for c in p.copies:
            if c.tag == "row":
                codes_shape = (m, cute.sym_int(divisibility=self.k_multiple * p.elem.bits // 8))
            else:
                codes_shape = (k, cute.sym_int())
            args += [
                fake(Uint8, codes_shape, stride_order=(1, 0), assumed_align=16),
                fake(
                    scale_t, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0), assumed_align=4
                ),
            ]
            if c.swizzled:
                args.append(fake(Uint8, (cute.sym_int(),), assumed_align=16))
        if p.prep:
            args.append(consts)
        elif p.global_scale:
            args += one + [fake(Float32, (1,), assumed_align=4) for _ in p.copies]
        else:
            args += [fake(Float32, (1,), assumed_align=4) for _ in p.copies]
        args += [Int32(0)] * p.philox_args  # seed, offsets, counter address, stride
        return cute.compile(self.entries["quantize"](arch), *args, stream, options=options)

    # ---- checking and launching
    def check_input(self, x: object) -> None:
        """Raise TensorError unless x is what the kernels take: a CUDA, contiguous, 16-byte
        aligned 2-D tensor of the spec's input dtype [M, K], K % k_multiple == 0, M %
        m_multiple == 0, 0 < M * K < 2^31."""
        host.check_input_2d(
            self.spec_name,
            x,
            dtype=self.input_torch,
            k_multiple=self.k_multiple,
            k_rule=self.k_rule,
            rows="M",
            m_multiple=self.m_multiple,
            m_rule=self.m_rule,
        )

    def counter_args(self, offset: int | tuple[int, ...] | DeviceOffset, x) -> list[int]:
        """The kernel's counter address and stride, (lo, hi) words each: a DeviceOffset's, or
        zeros for int offsets (address 0: the kernel reads nothing and uses the offsets as they
        are)."""
        if not isinstance(offset, DeviceOffset):
            return [0, 0, 0, 0]
        if offset.counter.device != x.device:
            raise ValueError(
                f"{self.spec_name}: the DeviceOffset counter is on {offset.counter.device}, the "
                f"input on {x.device}"
            )
        return host.u64_words(offset.counter.data_ptr()) + host.u64_words(offset.stride)

    def offsets(self, offset: int | tuple[int, ...] | DeviceOffset) -> tuple[int, ...]:
        """One Philox offset per output: an int serves every output, a tuple gives one each. For
        a DeviceOffset, its slots likewise (the kernel adds counter * stride to them)."""
        if isinstance(offset, DeviceOffset):
            offset = offset.slots[0] if len(offset.slots) == 1 else offset.slots
        tags = self.tags
        offsets = (offset,) * len(tags) if isinstance(offset, int) else tuple(offset)
        if len(offsets) != len(tags):
            outputs = tuple("rowwise" if t == "row" else "columnwise" for t in tags)
            raise ValueError(
                f"{self.spec_name}: expected one offset per output {outputs}, got {offset!r}"
            )
        for o in offsets:
            host.check_u64("offset", o)
        return offsets

    def launches(
        self,
        x: torch.Tensor,
        *,
        seed: int = 0,
        offset: int | tuple[int, ...] | DeviceOffset = 0,
    ) -> tuple[dict[str, torch.Tensor], list[tuple[str, tuple]]]:
        """Validate x and allocate the outputs: returns (outputs, [(kernel name, arguments)] in
        launch order). ``run`` launches them; a benchmark can time each launch on its own."""
        p = self.params
        self.check_input(x)
        host.check_u64("seed", seed)
        offsets = self.offsets(offset)
        M, K = x.shape
        dev = x.device
        nbm = -(-M // p.block)  # blocks along M
        nbk = K // p.block  # blocks along K
        out: dict[str, torch.Tensor] = {}
        args: list[object] = [x]
        for c in p.copies:
            if c.tag == "row":
                data = torch.empty((M, K * p.elem.bits // 8), dtype=torch.uint8, device=dev)
                scales = torch.empty(
                    (nbm if p.two_d else M, nbk), dtype=self.scale_torch, device=dev
                )
                rows, cols = M, nbk
            else:
                data = torch.empty((K, M * p.elem.bits // 8), dtype=torch.uint8, device=dev)
                scales = torch.empty(
                    (nbk if p.two_d else K, nbm), dtype=self.scale_torch, device=dev
                )
                rows, cols = K, nbm
            prefix = PREFIX[c.tag]
            out[prefix + "data"] = data
            out[prefix + "scales"] = scales
            args += [data, scales]
            if c.swizzled:
                swizzled = torch.zeros(
                    host.swizzled_bytes(rows, cols), dtype=torch.uint8, device=dev
                )
                out[prefix + "scales_swizzled"] = swizzled
                args.append(swizzled)
        plan: list[tuple[str, tuple]] = []
        copies = len(p.copies)
        if p.global_scale:
            if p.prep:
                # the amaxes and, after them, the amax kernel's CTA counter: zeroed by one
                # allocation
                amax = torch.zeros(self.slots + 1, dtype=torch.float32, device=dev)
                count = amax[self.slots :].view(torch.int32)
                consts = torch.empty(self.const_len, dtype=torch.float32, device=dev)
                s_dec = torch.empty(copies, dtype=torch.float32, device=dev)
                slots = [amax[s : s + 1] for s in range(self.slots)]
                s_decs = [s_dec[i : i + 1] for i in range(copies)]
                plan.append(("amax", (x, *slots, count, consts, *s_decs)))
                args.append(consts)
            else:
                amax = torch.zeros(self.slots, dtype=torch.float32, device=dev)
                s_dec = torch.empty(copies, dtype=torch.float32, device=dev)
                slots = [amax[s : s + 1] for s in range(self.slots)]
                plan.append(("amax", (x, *slots)))
                args += slots + [s_dec[i : i + 1] for i in range(copies)]
        else:
            # S_dec = 1 (no global scale), written here: the kernel stores NaN over a copy's
            # S_dec for an input with a NaN or an Inf, and only then
            s_dec = torch.ones(copies, dtype=torch.float32, device=dev)
            args += [s_dec[i : i + 1] for i in range(copies)]
        for i, c in enumerate(p.copies):
            out[PREFIX[c.tag] + "global_scale"] = s_dec[i]
        if p.sr:
            args += host.u64_words(seed)
            for i, c in enumerate(p.copies):
                if p.draws(c):
                    args += host.u64_words(offsets[i])
            args += self.counter_args(offset, x)
        plan.append(("quantize", tuple(args)))
        return out, plan

    def run(
        self,
        fns: Mapping[str, Callable],
        x: torch.Tensor,
        *,
        seed: int = 0,
        offset: int | tuple[int, ...] | DeviceOffset = 0,
    ) -> dict[str, torch.Tensor]:
        """Quantize x with the compiled kernels ``fns`` (name -> callable, see KERNELS).

        Returns, per copy, its packed codes, scale codes (uint8; fp32 values for fp32 scales),
        fp32 0-dim S_dec and, for the swizzled layout, the 128x4 tensor-core scale buffer:
        rowwise "data" [M, K*ELEM_BITS/8], "scales", "global_scale" ("scales_swizzled");
        columnwise "col_data" [K, M*ELEM_BITS/8], "col_scales", "col_global_scale"
        ("col_scales_swizzled"). ``seed``/``offset`` select the Philox stream of stochastic
        rounding (an offset per copy as a tuple in OUTPUTS order, or a DeviceOffset read by the
        kernel from device memory: fp4gen.device_offset; unused without SR). Each copy's S_dec
        is NaN iff x held a NaN or an Inf (NONFINITE_TO_NAN_SCALE). Raises TensorError for an
        input the kernels cannot take.
        """
        out, plan = self.launches(x, seed=seed, offset=offset)
        for name, args in plan:
            fns[name](*args)
        return out


__all__ = ["PREFIX", "TileHost"]
