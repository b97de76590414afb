"""The host side of the sm_90a fused GEMM modules (``templates/gemm_sm90.py.j2``: the wgmma
kernel; ``templates/gemm_sm90_small.py.j2``: the small-M kernel): compiling the kernel against
fake tensors, checking the operands, padding K and preparing the scale codes, the small-M
kernel's split-K workspace, and the launch. A generated module builds one ``GemmSm90Host`` or
``GemmSm90SmallHost`` from its spec's params and its kernel class and binds ``compile_kernel``,
``launch_args``, ``run`` (and ``tiles``, ``workspace``, ``a_scale_cols``) to it (the module
contract of ``fp4gen.codegen.gemm``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint8

from fp4gen.errors import TensorError
from fp4gen.kernels import host
from fp4gen.kernels.gemm_sm90 import GemmSm90Params
from fp4gen.kernels.gemm_sm90_small import GemmSm90SmallParams

KERNELS: tuple[str, ...] = ("gemm",)


def check_tensor(
    spec_name: str, name: str, t: object, dtype: torch.dtype, shape: tuple[int, ...], device
) -> None:
    """Raise TensorError unless operand ``name`` is a ``dtype`` tensor of ``shape`` on
    ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TensorError(f"{spec_name}: {name} must be a torch.Tensor, got {host.describe(t)}")
    if t.dtype != dtype or tuple(t.shape) != shape or t.device != device:
        raise TensorError(
            f"{spec_name}: {name} must be {dtype} {list(shape)} on {device}; got {host.describe(t)}"
        )


def padded(t: torch.Tensor, cols: int) -> torch.Tensor:
    """Contiguous, 16-byte aligned, zero-padded to ``cols`` columns (exact: code 0 is 0)."""
    t = t.contiguous()
    if t.shape[1] < cols:
        t = torch.nn.functional.pad(t, (0, cols - t.shape[1]))
    if t.data_ptr() % 16:
        t = t.clone()
    return t


@dataclass(frozen=True, eq=False)
class _GemmHost:
    """What both Hopper GEMM hosts share: the spec's operand rules and the operand checks."""

    spec_name: str
    archs: tuple[str, ...]
    a_block: int  # A: 1 x a_block blocks along K (B's blocks are as long)
    b_block: tuple[int, int]  # B's block shape: (1, N) or (16, 16)
    out_torch: torch.dtype
    entry: Callable[[], object]  # the module's kernel class (its name is the kernel symbol's)

    @property
    def kernels(self) -> tuple[str, ...]:
        return KERNELS

    @property
    def expand(self) -> int:
        """Scale codes per 16 values after the launcher's repeat (1, or 2 for 1x32 blocks)."""
        return self.a_block // 16

    def _options(self, name: str, arch: str, dump_dir: str | None, arch_note: str) -> str:
        return host.compile_options(
            self.spec_name, KERNELS, self.archs, name, arch, dump_dir, arch_note=arch_note
        )

    def check_rest(
        self,
        dev: torch.device,
        a_scales: object,
        a_global: object,
        b_scales: object,
        b_global: object,
        out: object,
        bias: object,
        *,
        M: int,
        N: int,
        k: int,
        has_bias: bool,
    ) -> None:
        """Raise TensorError unless the scale codes, the global scales, the output (and the
        bias) of an M x N x K product on ``dev`` are what the kernel takes."""
        spec = self.spec_name
        check_tensor(spec, "a_scales", a_scales, torch.uint8, (M, -(-k // self.a_block)), dev)
        b_rows = -(-N // 16) if self.b_block[0] > 1 else N
        check_tensor(
            spec, "b_scales", b_scales, torch.uint8, (b_rows, -(-k // self.b_block[1])), dev
        )
        for name, g in (("a_global", a_global), ("b_global", b_global)):
            if not isinstance(g, torch.Tensor) or g.numel() != 1 or g.dtype != torch.float32:
                raise TensorError(
                    f"{spec}: {name} must be one fp32 element; got {host.describe(g)}"
                )
            if g.device != dev:
                raise TensorError(f"{spec}: {name} is on {g.device}, the operands on {dev}")
        check_tensor(spec, "out", out, self.out_torch, (M, N), dev)
        assert isinstance(out, torch.Tensor)
        if not out.is_contiguous() or out.data_ptr() % 16:
            raise TensorError(f"{spec}: out must be contiguous and 16-byte aligned")
        if has_bias:
            check_tensor(spec, "bias", bias, torch.float32, (N,), dev)
        elif bias is not None:
            raise TensorError(f"{spec} was generated without a bias")


@dataclass(frozen=True, eq=False)
class GemmSm90Host(_GemmHost):
    """Compile, check and launch the wgmma kernel of one spec (operands decoded to bf16 in
    shared memory; both operands packed two codes per byte)."""

    params: GemmSm90Params

    def compile_kernel(self, name: str, arch: str, *, dump_dir: str | None = None):
        """The TVM-FFI compiled function of kernel ``name`` for ``arch`` (sm_90a), built against
        fake tensors with dynamic M, N and K (K % 64 == 0); needs no GPU. With ``dump_dir``
        (created if missing) the PTX is kept there."""
        p = self.params
        options = self._options(name, arch, dump_dir, " (wgmma)")
        fake = cute.runtime.make_fake_compact_tensor
        m, n = cute.sym_int(), cute.sym_int()
        code_bytes = cute.sym_int(divisibility=p.code_row_bytes)  # K / 2
        sf_cols = cute.sym_int(divisibility=p.sf_per_ktile)  # K / 16
        args = [
            fake(Uint8, (m, code_bytes), stride_order=(1, 0), assumed_align=16),
            fake(Uint8, (m, sf_cols), stride_order=(1, 0), assumed_align=16),
            fake(Uint8, (n, code_bytes), stride_order=(1, 0), assumed_align=16),
            fake(Uint8, (cute.sym_int(), sf_cols), stride_order=(1, 0), assumed_align=16),
            fake(Float32, (1,), assumed_align=4),
            fake(Float32, (1,), assumed_align=4),
            fake(p.out_dtype, (m, n), stride_order=(1, 0), assumed_align=16),
        ]
        if p.bias:
            args.append(fake(Float32, (n,), assumed_align=4))  # mBias
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(self.entry(), *args, stream, options=options)

    def launch_args(
        self,
        a_data: torch.Tensor,
        a_scales: torch.Tensor,
        a_global: torch.Tensor,
        b_data: torch.Tensor,
        b_scales: torch.Tensor,
        b_global: torch.Tensor,
        *,
        k: int,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple:
        """Validate the operands (see the module's docstring) and return the arguments of the
        compiled ``gemm`` function: K padded to a multiple of 64 with zero codes, 1x32 blocks'
        scale codes repeated to one per 16 values."""
        spec = self.spec_name
        if not isinstance(a_data, torch.Tensor) or a_data.dim() != 2:
            raise TensorError(
                f"{spec}: a_data must be uint8 [M, ceil(K/2)], got {host.describe(a_data)}"
            )
        dev = a_data.device
        if dev.type != "cuda":
            raise TensorError(f"{spec}: the operands must be on a CUDA device; got {dev}")
        if k < 1:
            raise TensorError(f"{spec}: K must be positive, got {k}")
        M = a_data.shape[0]
        N = b_data.shape[0] if isinstance(b_data, torch.Tensor) and b_data.dim() == 2 else -1
        code_cols = (k + 1) // 2
        check_tensor(spec, "a_data", a_data, torch.uint8, (M, code_cols), dev)
        check_tensor(spec, "b_data", b_data, torch.uint8, (N, code_cols), dev)
        has_bias = self.params.bias
        self.check_rest(
            dev, a_scales, a_global, b_scales, b_global, out, bias, M=M, N=N, k=k, has_bias=has_bias
        )
        if M * N >= 2**31 or max(M, N) * code_cols >= 2**31:
            raise TensorError(f"{spec}: M * N and max(M, N) * K / 2 must be below 2^31")
        tile_k = self.params.tile_k
        kp = -(-k // tile_k) * tile_k
        if self.expand > 1:
            a_scales = a_scales.repeat_interleave(self.expand, dim=1)
            b_scales = b_scales.repeat_interleave(self.expand, dim=1)
        args = (
            padded(a_data, kp // 2),
            padded(a_scales, kp // 16),
            padded(b_data, kp // 2),
            padded(b_scales, kp // 16),
            a_global.reshape(1),
            b_global.reshape(1),
            out,
        )
        if has_bias:
            assert bias is not None
            return (*args, bias.contiguous())
        return args

    def run(
        self,
        fns: Mapping[str, Callable],
        a_data: torch.Tensor,
        a_scales: torch.Tensor,
        a_global: torch.Tensor,
        b_data: torch.Tensor,
        b_scales: torch.Tensor,
        b_global: torch.Tensor,
        *,
        k: int,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """out (+)= S_a S_b (A @ B^T) (+ bias) with the compiled kernel ``fns["gemm"]`` (see
        launch_args for the operands); returns ``out``. Raises TensorError for operands the
        kernel cannot take."""
        args = self.launch_args(
            a_data, a_scales, a_global, b_data, b_scales, b_global, k=k, out=out, bias=bias
        )
        fns["gemm"](*args)
        return out


@dataclass(frozen=True, eq=False)
class GemmSm90SmallHost(_GemmHost):
    """Compile, check and launch the small-M kernel of one spec (mma.sync on operands decoded
    in registers, split-K across CTAs; A one code per byte, B packed two per byte)."""

    params: GemmSm90SmallParams

    def compile_kernel(self, name: str, arch: str, *, dump_dir: str | None = None):
        """The TVM-FFI compiled function of kernel ``name`` for ``arch`` (sm_90a), built against
        fake tensors with dynamic M, N, K and splits (K % stage_k == 0); needs no GPU. With
        ``dump_dir`` (created if missing) the PTX is kept there."""
        p = self.params
        options = self._options(name, arch, dump_dir, " (mma.sync + TMA)")
        fake = cute.runtime.make_fake_compact_tensor
        m, n = cute.sym_int(), cute.sym_int()
        a_cols = cute.sym_int(divisibility=p.stage_k)  # K
        b_cols = cute.sym_int(divisibility=p.stage_k // 2)  # K / 2
        sf_cols = cute.sym_int(divisibility=p.sf_row_bytes)  # K / 16
        # A's scale codes: a_scale_cols(K) of its 1x32 codes, or K / 16
        a_sf_cols = cute.sym_int(divisibility=p.a_sf_copy_bytes) if p.a_sf_32 else sf_cols
        args = [
            fake(Uint8, (m, a_cols), stride_order=(1, 0), assumed_align=16),
            fake(Uint8, (m, a_sf_cols), stride_order=(1, 0), assumed_align=16),
            fake(Uint8, (n, b_cols), stride_order=(1, 0), assumed_align=16),
            fake(Uint8, (cute.sym_int(), sf_cols), stride_order=(1, 0), assumed_align=16),
            fake(Float32, (1,), assumed_align=4),
            fake(Float32, (1,), assumed_align=4),
            fake(p.out_dtype, (m, n), stride_order=(1, 0), assumed_align=16),
        ]
        if p.bias:
            args.append(fake(Float32, (n,), assumed_align=4))  # mBias
        args.append(
            fake(
                Float32,
                (cute.sym_int(), cute.sym_int(divisibility=p.tile_elems)),
                stride_order=(1, 0),
                assumed_align=16,
            )
        )
        args.append(fake(Int32, (cute.sym_int(),), assumed_align=16))
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(self.entry(), *args, stream, options=options)

    def a_scale_cols(self, kp: int) -> int:
        """Columns of A's scale codes as the kernel reads them, for K padded to ``kp``: K/16,
        or with 1x32 codes read as they are K/32 padded to a multiple of 4 (each row's
        cp.async words stay aligned)."""
        if self.params.a_sf_32:
            return -(-(kp // 32) // 4) * 4
        return kp // 16

    def tiles(self, m: int, n: int) -> int:
        """Output tiles of an M x N product (the counters a call needs)."""
        p = self.params
        return -(-m // p.tile_m) * -(-n // p.tile_n)

    def workspace(self, m: int, n: int, splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 [splits, tiles * TILE_ELEMS] partial tiles, int32 [tiles] zero counters) for an
        M x N product split ``splits`` ways along K. Reusable by later calls on the same
        stream: the last CTA of each tile resets its counter."""
        t = self.tiles(m, n)
        elems = self.params.tile_elems
        ws = torch.empty((splits, t * elems if splits > 1 else elems), device=device)
        return ws, torch.zeros(t, dtype=torch.int32, device=device)

    def launch_args(
        self,
        a_codes: torch.Tensor,
        a_scales: torch.Tensor,
        a_global: torch.Tensor,
        b_data: torch.Tensor,
        b_scales: torch.Tensor,
        b_global: torch.Tensor,
        *,
        k: int,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
        splits: int = 1,
        ws: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple:
        """Validate the operands (see the module's docstring) and return the arguments of the
        compiled ``gemm`` function: K padded to a multiple of stage_k with zero codes, B's 1x32
        scale codes repeated to one per 16 values (A's as they are). ``splits``: ways K is
        split across CTAs (1 <= splits <= ceil(K / stage_k)); ``ws``: the (workspace,
        counters) pair of ``workspace(M, N, splits, device)`` (allocated when None)."""
        spec, p = self.spec_name, self.params
        if not isinstance(a_codes, torch.Tensor) or a_codes.dim() != 2:
            raise TensorError(f"{spec}: a_codes must be uint8 [M, K], got {host.describe(a_codes)}")
        dev = a_codes.device
        if dev.type != "cuda":
            raise TensorError(f"{spec}: the operands must be on a CUDA device; got {dev}")
        if k < 1:
            raise TensorError(f"{spec}: K must be positive, got {k}")
        M = a_codes.shape[0]
        N = b_data.shape[0] if isinstance(b_data, torch.Tensor) and b_data.dim() == 2 else -1
        check_tensor(spec, "a_codes", a_codes, torch.uint8, (M, k), dev)
        check_tensor(spec, "b_data", b_data, torch.uint8, (N, (k + 1) // 2), dev)
        self.check_rest(
            dev, a_scales, a_global, b_scales, b_global, out, bias, M=M, N=N, k=k, has_bias=p.bias
        )
        stage_k = p.stage_k
        kp = -(-k // stage_k) * stage_k
        if M * N >= 2**31 or max(M, N) * kp >= 2**31:
            raise TensorError(f"{spec}: M * N and max(M, N) * K must be below 2^31")
        if not 1 <= splits <= kp // stage_k:
            raise TensorError(
                f"{spec}: splits must be in [1, ceil(K / {stage_k})] (whole stages), got {splits}"
            )
        if ws is None:
            ws = self.workspace(M, N, splits, dev)
        work, counters = ws
        elems = p.tile_elems
        need = self.tiles(M, N) * elems if splits > 1 else elems
        if (
            work.dtype != torch.float32
            or work.dim() != 2
            or work.shape[0] != splits
            or work.shape[1] < need
            or work.shape[1] % elems
            or counters.dtype != torch.int32
            or counters.numel() < self.tiles(M, N)
        ):
            raise TensorError(
                f"{spec}: ws must be workspace(M, N, splits, device); got "
                f"{host.describe(work)}, {host.describe(counters)}"
            )
        if self.expand > 1:
            if not p.a_sf_32:
                a_scales = a_scales.repeat_interleave(self.expand, dim=1)
            b_scales = b_scales.repeat_interleave(self.expand, dim=1)
        args = (
            padded(a_codes, kp),
            padded(a_scales, self.a_scale_cols(kp)),
            padded(b_data, kp // 2),
            padded(b_scales, kp // 16),
            a_global.reshape(1),
            b_global.reshape(1),
            out,
        )
        if p.bias:
            assert bias is not None
            return (*args, bias.contiguous(), work, counters)
        return (*args, work, counters)

    def run(
        self,
        fns: Mapping[str, Callable],
        a_codes: torch.Tensor,
        a_scales: torch.Tensor,
        a_global: torch.Tensor,
        b_data: torch.Tensor,
        b_scales: torch.Tensor,
        b_global: torch.Tensor,
        *,
        k: int,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
        splits: int = 1,
    ) -> torch.Tensor:
        """out (+)= S_a S_b (A @ B^T) (+ bias) with the compiled kernel ``fns["gemm"]`` (see
        launch_args for the operands; A is one code per byte); returns ``out``. Raises
        TensorError for operands the kernel cannot take."""
        args = self.launch_args(
            a_codes,
            a_scales,
            a_global,
            b_data,
            b_scales,
            b_global,
            k=k,
            out=out,
            bias=bias,
            splits=splits,
        )
        fns["gemm"](*args)
        return out


__all__ = ["GemmSm90Host", "GemmSm90SmallHost", "check_tensor", "padded"]
