"""The host side of a Mixture-of-Representations module (``templates/mor.py.j2``): compiling its
kernels against fake tensors, checking the input, allocating the buffers and outputs and listing
the launches (amax, scales, then quantize, or measure, decide and emit). The generated module
builds one ``MoRHost`` from its rule's ``MoRMeasureParams`` and its kernel classes and binds
``compile_kernel``, ``check_input``, ``launches`` and ``run`` to it (the module contract of
``fp4gen.codegen.mor``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Float64, Int32, Int64, Uint8

from fp4gen.kernels import host
from fp4gen.kernels.mor import VEC, MoRMeasureParams
from fp4gen.vocab import DTYPES


def grid_of(rows: int, cols: int, row_shift: int, col_shift: int) -> tuple[int, int]:
    """Units of a partition given as shifts: ((rows - 1) >> row_shift) + 1, the same for cols."""
    return ((rows - 1) >> row_shift) + 1, ((cols - 1) >> col_shift) + 1


@dataclass(frozen=True, eq=False)
class MoRHost:
    """Compile, check and launch the kernels of one MoR rule."""

    spec_name: str
    kernels: tuple[str, ...]  # ("amax", "scales", "quantize") or (..., "measure", "decide", "emit")
    archs: tuple[str, ...]
    params: MoRMeasureParams
    # kernel name -> the module's kernel class (its name is the kernel symbol's), built per arch
    entries: Mapping[str, Callable[[str], object]] = field(default_factory=dict)

    @property
    def fused(self) -> bool:
        """Decided in the quantizing pass (every decision unit fits in a tile)."""
        return "quantize" in self.kernels

    @property
    def input_torch(self) -> torch.dtype:
        return getattr(torch, DTYPES[self.params.input_dtype].torch_name)

    @property
    def high_torch(self) -> torch.dtype | None:
        """The high-precision values' dtype; None without a high-precision candidate."""
        high = self.params.high
        return None if high is None else getattr(torch, DTYPES[high].torch_name)

    def compile_kernel(self, name: str, arch: str, *, dump_dir: str | None = None):
        """The TVM-FFI compiled callable of kernel ``name`` for ``arch`` ("sm_90a" or
        "sm_100a"), built against fake tensors with dynamic R and K (K % VEC == 0); needs no
        GPU. With ``dump_dir`` (created if missing) the PTX is kept there."""
        p = self.params
        options = host.compile_options(
            self.spec_name, self.kernels, self.archs, name, arch, dump_dir
        )
        fake = cute.runtime.make_fake_compact_tensor

        def flat(dtype, align: int = 16):
            return fake(dtype, (cute.sym_int(),), assumed_align=align)

        r, k = cute.sym_int(), cute.sym_int(divisibility=VEC)
        input_t = getattr(cutlass, DTYPES[p.input_dtype].cute)
        x = fake(input_t, (r, k), stride_order=(1, 0), assumed_align=16)
        codes = fake(Uint8, (r, k), stride_order=(1, 0), assumed_align=16)
        outs = [codes]  # the chosen codes, then the high-precision values
        if p.high is not None:
            high_t = getattr(cutlass, DTYPES[p.high].cute)
            outs.append(fake(high_t, (r, k), stride_order=(1, 0), assumed_align=16))
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        entry = self.entries[name](arch)
        if name == "amax":
            return cute.compile(entry, x, flat(Int32), stream, options=options)
        if name == "scales":
            args = [flat(Int32), flat(Float32), flat(Float64), flat(Int32), flat(Float32)]
            return cute.compile(entry, *args, Int32(1), Int32(8), stream, options=options)
        scales = [flat(Float32), flat(Float64)]
        if name == "quantize":
            args = [x, *scales, *outs, flat(Int64), flat(Float64), flat(Int64)]
            return cute.compile(entry, *args, stream, options=options)
        stats = [flat(Int32)]  # per piece: the non-zero count (and max / min |x|)
        if p.uses_range:
            stats += [flat(Float32), flat(Float32)]
        if name == "measure":
            args = [x, *scales, flat(Float64), *stats]
            return cute.compile(entry, *args, stream, options=options)
        if name == "decide":
            args = [flat(Float64), *stats, flat(Int64), flat(Float64), flat(Int64)]
            return cute.compile(entry, *args, Int32(1), Int32(8), stream, options=options)
        args = [x, *scales, flat(Int64), *outs]  # emit
        return cute.compile(entry, *args, stream, options=options)

    def check_input(self, x: object) -> None:
        """Raise TensorError unless x is what the kernels take: a CUDA, contiguous, 16-byte
        aligned 2-D tensor of the rule's input dtype [R, K], K % VEC == 0, 0 < R * K < 2^31."""
        host.check_input_2d(
            self.spec_name,
            x,
            dtype=self.input_torch,
            k_multiple=VEC,
            k_rule="8-element loads",
            rows="R",
        )

    def launches(
        self, x: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor | None], list[tuple[str, tuple]]]:
        """Validate x and allocate the outputs: returns (outputs, [(kernel name, arguments)] in
        launch order). ``run`` launches them; a benchmark can time each launch on its own."""
        p = self.params
        self.check_input(x)
        R, K = x.shape
        dev = x.device
        nbr, nbc = grid_of(R, K, p.scale_row_shift, p.scale_col_shift)
        nur, nuc = grid_of(R, K, p.unit_row_shift, p.unit_col_shift)
        nb, nu = nbr * nbc, nur * nuc
        n_elem, n_reps = p.n_elem, len(p.reps)
        # fp32 bits of each block's amax; the last: the tensor's
        amax = torch.zeros(nb + 1, dtype=torch.int32, device=dev)
        enc = torch.empty(n_elem * nb, dtype=torch.float32, device=dev)
        dec = torch.empty(n_elem * nb, dtype=torch.float64, device=dev)
        exp = torch.empty(n_elem * nb, dtype=torch.int32, device=dev)
        mant = torch.empty(n_elem, dtype=torch.float32, device=dev)
        codes = torch.empty((R, K), dtype=torch.uint8, device=dev)
        high = None
        outs = [codes]
        if self.high_torch is not None:
            high = torch.empty((R, K), dtype=self.high_torch, device=dev)
            outs.append(high)
        choice = torch.empty(nu, dtype=torch.int64, device=dev)
        err = torch.empty(n_reps * nu, dtype=torch.float64, device=dev)
        nonzero = torch.empty(nu, dtype=torch.int64, device=dev)
        plan: list[tuple[str, tuple]] = [
            ("amax", (x, amax)),
            ("scales", (amax, enc, dec, exp, mant, R, K)),
        ]
        if self.fused:
            plan.append(("quantize", (x, enc, dec, *outs, choice, err, nonzero)))
        else:
            npr, npc = grid_of(R, K, p.unit_row_bits, p.unit_col_bits)
            partial = torch.empty(n_reps * npr * npc, dtype=torch.float64, device=dev)
            stats = [torch.empty(npr * npc, dtype=torch.int32, device=dev)]
            if p.uses_range:
                stats += [torch.empty(npr * npc, dtype=torch.float32, device=dev) for _ in range(2)]
            plan.append(("measure", (x, enc, dec, partial, *stats)))
            plan.append(("decide", (partial, *stats, choice, err, nonzero, R, K)))
            plan.append(("emit", (x, enc, dec, choice, *outs)))
        out = {
            "amax": amax,
            "choice": choice.reshape(nur, nuc),
            "codes": codes,
            "high": high,
            "error_sum": err.reshape(n_reps, nur, nuc),
            "nonzero": nonzero.reshape(nur, nuc),
            "encode": enc.reshape(n_elem, nbr, nbc),
            "decode": dec.reshape(n_elem, nbr, nbc),
            "exponent": exp.reshape(n_elem, nbr, nbc),
            "mantissa": mant,
        }
        return out, plan

    def run(self, fns: Mapping[str, Callable], x: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """Run the MoR rule on x [R, K] with the compiled kernels ``fns`` (name -> callable).

        Returns {"choice": int64 [units], "codes": uint8 [R, K] (the chosen element format's
        codes, 0 elsewhere), "high": [R, K] high-precision values (0 elsewhere; None without
        such a candidate), "error_sum": float64 [N_REPS, units], "nonzero": int64 [units],
        "encode" / "decode" / "exponent": [N_ELEM, scale blocks], "mantissa": fp32 [N_ELEM]
        (gam), "amax": int32 [blocks + 1] (fp32 bits; the last is the tensor's, for the
        finiteness check)}. No host synchronisation. Raises TensorError for an input the
        kernels cannot take.
        """
        out, plan = self.launches(x)
        for name, args in plan:
            fns[name](*args)
        return out


__all__ = ["MoRHost", "grid_of"]
