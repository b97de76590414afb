"""PTX inline-asm wrappers of the Hopper GEMMs (``gemm_sm90``, ``gemm_sm90_small``) and their
e2m1 decodes (``sm90_decode``): shared- and global-memory loads and stores of the widths the
kernels move, cp.async of 4, 8 or 16 bytes, the split-K counter's atomic, mma.sync m16n8k16,
byte permutes and the bf16x2 multiply by a broadcast half. None knows a number format.

Why inline asm: the kernels address shared memory by 32-bit integers they compute themselves
(offsets into their stages) and need exact widths, cache operators and memory orders. Loads
and stores are side effects ("~{memory}"), so they stay where the kernel puts them, after the
mbarrier waits and before the arrivals; pure math is free for LLVM to schedule.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Numeric, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def inline_asm(ret, operands, text, constraints, side_effects=False):
    """One PTX inline-asm statement (AT&T dialect, no stack alignment)."""
    return llvm.inline_asm(
        ret,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def ir_arg(x, t: type[Numeric], loc, ip):
    """``x`` as an MLIR value of DSL type ``t`` (an inline-asm operand)."""
    return t(x).ir_value(loc=loc, ip=ip)


# ----------------------------------------------------------------------------------------------
# Loads and stores: ld/st.<space>[.v<n>].<type>
# ----------------------------------------------------------------------------------------------
# a value's PTX type -> its DSL type, inline-asm register class and MLIR type name
_VALUE = {"b32": (Uint32, "r", "i32"), "u16": (Uint32, "r", "i32"), "f32": (Float32, "f", "f32")}


def _address(space: str) -> tuple[type[Numeric], str]:
    """The address operand of a state space: shared-window addresses are 32-bit, global 64."""
    return (Int64, "l") if "global" in space else (Int32, "r")


def _vector(ptx_type: str, n: int) -> str:
    return f"v{n}.{ptx_type}" if n > 1 else ptx_type


def _load(space: str, ptx_type: str, n: int, addr, loc, ip):
    """``ld.<space>`` of n values of ``ptx_type`` (a tuple, or the value itself for n = 1)."""
    addr_t, addr_reg = _address(space)
    val_t, reg, mlir_t = _VALUE[ptx_type]
    if n == 1:
        res = inline_asm(
            ir.Type.parse(mlir_t),
            [ir_arg(addr, addr_t, loc, ip)],
            f"ld.{space}.{ptx_type} $0, [$1];",
            f"={reg},{addr_reg},~{{memory}}",
            True,
        )
        return val_t(res)
    outs = ", ".join(f"${i}" for i in range(n))
    res = inline_asm(
        ir.Type.parse(f"!llvm.struct<({', '.join([mlir_t] * n)})>"),
        [ir_arg(addr, addr_t, loc, ip)],
        f"ld.{space}.{_vector(ptx_type, n)} {{{outs}}}, [${n}];",
        ",".join([f"={reg}"] * n + [addr_reg, "~{memory}"]),
        side_effects=True,
    )
    elem = ir.Type.parse(mlir_t)
    return tuple(val_t(llvm.extractvalue(elem, res, [i], loc=loc, ip=ip)) for i in range(n))


def _store(space: str, ptx_type: str, addr, values: tuple, loc, ip) -> None:
    """``st.<space>`` of ``values`` (one, or a vector of them) of ``ptx_type``."""
    addr_t, addr_reg = _address(space)
    val_t, reg, _ = _VALUE[ptx_type]
    n = len(values)
    ins = ", ".join(f"${i + 1}" for i in range(n))
    operands = ins if n == 1 else "{" + ins + "}"
    inline_asm(
        None,
        [ir_arg(addr, addr_t, loc, ip)] + [ir_arg(v, val_t, loc, ip) for v in values],
        f"st.{space}.{_vector(ptx_type, n)} [$0], {operands};",
        ",".join([addr_reg] + [reg] * n + ["~{memory}"]),
        True,
    )


@dsl_user_op
def lds_u16(addr: Int32, *, loc=None, ip=None) -> Uint32:
    """2-byte shared load (two scale codes)."""
    return _load("shared", "u16", 1, addr, loc, ip)


@dsl_user_op
def lds_u32(addr: Int32, *, loc=None, ip=None) -> Uint32:
    """4-byte shared load."""
    return _load("shared", "b32", 1, addr, loc, ip)


@dsl_user_op
def lds_v2(addr: Int32, *, loc=None, ip=None) -> tuple[Uint32, Uint32]:
    """8-byte shared load."""
    return _load("shared", "b32", 2, addr, loc, ip)


@dsl_user_op
def lds_v4(addr: Int32, *, loc=None, ip=None) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """16-byte shared load."""
    return _load("shared", "b32", 4, addr, loc, ip)


@dsl_user_op
def lds_v4_f32(addr: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """Four fp32 from shared memory."""
    return _load("shared", "f32", 4, addr, loc, ip)


@dsl_user_op
def ldg_cg_v4_f32(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """Four fp32 from global memory through L2 only (other CTAs wrote them)."""
    return _load("global.cg", "f32", 4, addr, loc, ip)


@dsl_user_op
def sts_u32(addr: Int32, v: Uint32, *, loc=None, ip=None) -> None:
    """4-byte shared store."""
    _store("shared", "b32", addr, (v,), loc, ip)


@dsl_user_op
def sts_v4(addr: Int32, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None) -> None:
    """16-byte shared store."""
    _store("shared", "b32", addr, (a, b, c, d), loc, ip)


@dsl_user_op
def sts_v2_f32(addr: Int32, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """Two fp32 to shared memory."""
    _store("shared", "f32", addr, (a, b), loc, ip)


@dsl_user_op
def stg_v4_f32(
    addr: Int64, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None
) -> None:
    """Four fp32 to global memory (the split-K workspace)."""
    _store("global", "f32", addr, (a, b, c, d), loc, ip)


@dsl_user_op
def stg_u32_relaxed(addr: Int64, v: Uint32, *, loc=None, ip=None) -> None:
    """4-byte global store, relaxed at GPU scope (the split-K counter's reset)."""
    _store("relaxed.gpu.global", "b32", addr, (v,), loc, ip)


@dsl_user_op
def cp_async(dst_smem: Int32, src_gmem: Int64, nbytes: int, *, loc=None, ip=None) -> None:
    """4-, 8- or 16-byte cp.async global -> shared (completion tracked by an mbarrier)."""
    inline_asm(
        None,
        [ir_arg(dst_smem, Int32, loc, ip), ir_arg(src_gmem, Int64, loc, ip)],
        f"cp.async.ca.shared.global [$0], [$1], {nbytes};",
        "r,l,~{memory}",
        True,
    )


@dsl_user_op
def atom_add_acq_rel(addr: Int64, v: Uint32, *, loc=None, ip=None) -> Uint32:
    """Atomic add on a global u32 with acquire-release semantics at GPU scope; the old value."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(addr, Int64, loc, ip), ir_arg(v, Uint32, loc, ip)],
            "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;",
            "=r,l,r,~{memory}",
            True,
        )
    )


# ----------------------------------------------------------------------------------------------
# Math
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def mma_16816(a, b, c, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """mma.sync m16n8k16, bf16 x bf16 -> fp32: a = 4 bf16x2 words (rows g / g+8, k 2q.. /
    2q+8..), b = 2 bf16x2 words (k 2q.. / 2q+8.., column g), c = 4 fp32 (rows g, g+8; columns
    2q, 2q+1); returns d = a b + c."""
    st = ir.Type.parse("!llvm.struct<(f32, f32, f32, f32)>")
    ops = [ir_arg(x, Uint32, loc, ip) for x in (*a, *b)] + [ir_arg(x, Float32, loc, ip) for x in c]
    res = inline_asm(
        st,
        ops,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def mul_bf16x2_bcast(a: Uint32, pair: Uint32, hi: bool, *, loc=None, ip=None) -> Uint32:
    """a (bf16x2) times one bf16 half of ``pair`` broadcast to both halves (ptxas folds the
    broadcast into the HMUL2 operand swizzle)."""
    half = "h" if hi else "l"
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(a, Uint32, loc, ip), ir_arg(pair, Uint32, loc, ip)],
            "{\n\t.reg .b16 l, h;\n\t.reg .b32 s;\n\t"
            "mov.b32 {l, h}, $2;\n\t"
            "mov.b32 s, {" + half + ", " + half + "};\n\t"
            "mul.rn.bf16x2 $0, $1, s;\n\t}",
            "=r,r,r",
        )
    )


@dsl_user_op
def prmt(a: Uint32, b: Uint32, sel: int | Uint32, *, loc=None, ip=None) -> Uint32:
    """Byte permute of {b, a}: an immediate selector (a Python int) or a register one (the
    table lookups, whose selector is data)."""
    operands = [ir_arg(a, Uint32, loc, ip), ir_arg(b, Uint32, loc, ip)]
    if isinstance(sel, int):
        text, constraints = f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r"
    else:
        operands.append(ir_arg(sel, Uint32, loc, ip))
        text, constraints = "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r"
    return Uint32(inline_asm(T.i32(), operands, text, constraints))
