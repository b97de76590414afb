"""A stand-in for the quantize template in compiler tests: ``render_stub(spec)`` returns a tiny
generated module with the real contract (KERNELS, compile_kernel, run) whose kernels scale a flat
fp32 tensor. It compiles in a fraction of a second, and like the template it supports only single
rowwise outputs of 1D blocks (NotImplementedError otherwise); a MoR spec gets one "mor" kernel."""

from __future__ import annotations

from fp4gen.spec import MoRKernelSpec, QuantKernelSpec

STUB = '''\
"""fp4gen test stub for {name}: the generated-module contract around trivial kernels."""

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32

SPEC_NAME = {name!r}
KERNELS = {kernels!r}
FACTORS = {factors!r}


class ScaleKernel:
    def __init__(self, factor: float):
        self.factor = factor

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
        n = cute.size(mX)
        self.kernel(mX, mY, n).launch(
            grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, n: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < n:
            mY[i] = mX[i] * Float32(self.factor)


def compile_kernel(name, arch, *, dump_dir=None):
    n = cute.sym_int()
    x = cute.runtime.make_fake_compact_tensor(Float32, (n,), assumed_align=16)
    y = cute.runtime.make_fake_compact_tensor(Float32, (n,), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi --gpu-arch {{arch}}"
    if dump_dir is not None:
        options += f" --keep-ptx --dump-dir {{dump_dir}}"
    return cute.compile(ScaleKernel(FACTORS[name]), x, y, stream, options=options)


def run(fns, x, *, seed=0, offset=0):
    import torch

    y = x.float().reshape(-1).contiguous()
    for name in KERNELS:
        out = torch.empty_like(y)
        fns[name](y, out)
        y = out
    return {{"data": y, "scales": y, "global_scale": torch.ones((), device=x.device)}}
'''


def render_stub(spec: QuantKernelSpec | MoRKernelSpec) -> str:
    if isinstance(spec, MoRKernelSpec):
        return STUB.format(name=spec.name, kernels=("mor",), factors={"mor": 1.0})
    if [o.direction for o in spec.outputs] != ["rowwise"]:
        raise NotImplementedError(f"{spec.name}: only a single rowwise output (stub)")
    if spec.block[0] != 1:
        raise NotImplementedError(f"{spec.name}: no 2D blocks (stub)")
    kernels = ("amax", "quantize") if spec.global_scale else ("quantize",)
    factors = {k: float(i + 2) for i, k in enumerate(kernels)}
    return STUB.format(name=spec.name, kernels=kernels, factors=factors)
