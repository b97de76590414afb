"""Where the time of the fused wgmma GEMM goes: the generated kernel with parts of its mainloop
removed, timed against cuBLAS BF16 and against the kernel as generated (Hopper).

    python benchmarks/gemm_ablation.py [--shape 8192x8192x8192] [--variants full,no-decode,...]
    python benchmarks/gemm_ablation.py --tile r16 [--shape 16x8192x8192]   # a small-M kernel
    python benchmarks/gemm_ablation.py --compile-only [--tile r16]   # patch and cross-compile

The module of the large-M tile (NVFP4: A 1x16 blocks, B 16x16 blocks, bf16 out; tile
``m128n256w2s5``) is rendered by fp4gen.codegen.gemm.render_gemm and made self-contained: the
kernel class it binds (fp4gen/kernels/gemm_sm90.py, where the mainloop is) goes in front of it.
Each variant then replaces one piece of that source text (every replacement must match exactly
once, so a kernel or template change that moves the piece stops the benchmark instead of timing
the wrong thing). Only "full" computes the product; the others leave stale or partial data in
the decoded stages and are for timing alone:

  full                the kernel as generated
  no-fence            without the fence.proxy.async that hands the decoded stores to wgmma
  no-decode           no code loads, decode or stores: TMA, mbarriers, fence, named barrier and
                      wgmma only (what the pipeline costs without the dequantization)
  no-decode-no-fence  the same without the fence
  decode-no-store     the code loads and the decode arithmetic, the words folded into one
                      register (one XOR each) instead of stored
  store-no-decode     the code loads and the stores (the raw code words), no decode arithmetic
  fewer-decode-ops    the decode in 14 instructions per 8 values instead of 20 (what a
                      GEMM-specific bit layout of the packed codes would allow)
  a-only              only A's rows decoded: the bound for a kernel whose B is decoded for free
  half-b              A and half of B's rows decoded: the work per CTA of a 2-CTA cluster that
                      shares B's decode, without the remote stores such sharing needs
  quarter-b           A and a quarter of B's rows (a 4-CTA cluster, likewise)

The small-M kernels (--tile r16, r32, r64: mma.sync on operands decoded in registers) take
"full", "fewer-decode-ops" and "no-decode" (the code words passed to the mma undecoded); their
patches replace the decodes the generated module imports and hands its kernel class
(fp4gen/kernels/gemm_sm90_small.py) with definitions of its own.

Inputs: random codes, block scales 1.0, global scales 1; two operand sets (four for the
small-M kernels) rotated so that consecutive calls do not find their operands in L2. CUDA
events, best of 3 runs. Measured figures and what they mean: docs/gemm-sm90.md, "Where the
wgmma kernel's time goes" and "What is left".
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

from benchmarks.gemm import bench  # CUDA events, best of 3, inputs rotated by call
from fp4gen.codegen.gemm import TILES, SmallMTile, choose_splits, gemm_spec, render_gemm
from fp4gen.formats import BUILTIN_FORMATS

Patch = Callable[[str], str]
ONE_E4M3 = 0x38  # the e4m3 code of 1.0

FENCE = '        cute.arch.fence_proxy("async.shared", space="cta")'
DECODE_START = "        codes = []\n        scales = []\n"
STORE_LOOP = """        for i in range_constexpr(p.units_per_thread):
            if valid[i]:
                dst = cutlass.select_(is_a[i], da, db) + dst_off[i]
                for w in range_constexpr(4):
"""
STORE_CALL = "                    o = self.decode8(codes[i][w], scales[i], w >= 2)\n"
STORE_WORDS = "                    sts_v4(dst + ((chunk[i] ^ w) << 4), o[0], o[1], o[2], o[3])\n"


def _replace_once(src: str, old: str, new: str) -> str:
    count = src.count(old)
    if count != 1:
        raise RuntimeError(
            f"ablation patch: expected one occurrence of {old.splitlines()[0].strip()!r} in "
            f"the generated module, found {count} (has the template changed?)"
        )
    return src.replace(old, new)


def _find(src: str, piece: str, start: int = 0) -> int:
    """Where ``piece`` starts in the generated module (from ``start``), or a clear error."""
    at = src.find(piece, start)
    if at < 0:
        raise RuntimeError(
            f"ablation patch: {piece.splitlines()[0].strip()!r} is not in the generated module "
            "(has the template changed?)"
        )
    return at


# what a replacement decode8 in the generated module reads (the module imports its decode
# from fp4gen.kernels.sm90_decode and its host code from fp4gen.kernels.gemm_sm90_host, and no
# longer holds these names itself)
DECODE_NAMES = (
    "import cutlass\n"
    "import cutlass.cute as cute\n"
    "from cutlass import Uint32\n"
    "from fp4gen.kernels.sm90_decode import MAG_BITS, SIGN_BITS, mul_bf16x2_bcast\n"
)


def _local_decode8(
    src: str, definition: str, imported: str = "from fp4gen.kernels.sm90_decode import decode8_"
) -> str:
    """``src`` with decode8 (or the function of the import line starting ``imported``) defined
    by ``definition`` in the module instead of imported (defined at the end: the kernel class
    is given it when the module compiles its kernel)."""
    start = _find(src, imported)
    line = src[start : _find(src, "\n", start) + 1]
    return _replace_once(src, line, "") + "\n\n" + DECODE_NAMES + "\n\n" + definition


FUTURE = "from __future__ import annotations\n"
KERNEL_IMPORT = "from fp4gen.kernels.gemm_sm90 import "


def with_kernel_class(src: str) -> str:
    """The generated wgmma module ``src`` made self-contained: the source of
    fp4gen.kernels.gemm_sm90 (the kernel's body, which the patches edit), then the generated
    module without its import of that module (its subclass and PARAMS take the classes defined
    above)."""
    origin = importlib.util.find_spec("fp4gen.kernels.gemm_sm90").origin
    assert origin is not None
    line = src[_find(src, KERNEL_IMPORT) : _find(src, "\n", _find(src, KERNEL_IMPORT)) + 1]
    generated = _replace_once(_replace_once(src, line, ""), FUTURE, "")
    return Path(origin).read_text() + "\n\n" + generated


def _with_uint32(src: str) -> str:
    """``src`` with cutlass's Uint32 imported (a patch's code uses it)."""
    return _replace_once(src, FUTURE, FUTURE + "\nfrom cutlass import Uint32  # noqa: E402\n")


def drop_fence(src: str) -> str:
    line = src[_find(src, FENCE) : _find(src, "\n", _find(src, FENCE)) + 1]
    return _replace_once(src, line, "")


def drop_decode(src: str) -> str:
    start = _find(src, DECODE_START)
    return _replace_once(src, src[start : _find(src, FENCE)], "")


def decode_no_store(src: str) -> str:
    # every decoded word folds into one register; the store it feeds is never taken
    start = _find(src, STORE_LOOP)
    body = src[start : _find(src, STORE_WORDS, start) + len(STORE_WORDS)]
    folded = """        folded = Uint32(0)
        for i in range_constexpr(p.units_per_thread):
            if valid[i]:
                for w in range_constexpr(4):
                    o = self.decode8(codes[i][w], scales[i], w >= 2)
                    folded = folded ^ o[0] ^ o[1] ^ o[2] ^ o[3]
        if folded == Uint32(0x12345679):
            sts_v4(da, folded, folded, folded, folded)
"""
    return _with_uint32(_replace_once(src, body, folded))


def store_no_decode(src: str) -> str:
    raw = (
        "                    x = codes[i][w]\n"
        "                    sts_v4(dst + ((chunk[i] ^ w) << 4), x, x ^ scales[i], x, x)\n"
    )
    return _replace_once(src, STORE_CALL + STORE_WORDS, raw)


def fewer_decode_ops(src: str) -> str:
    """decode8 as 14 instructions per 8 values instead of 20: the sequence a GEMM-specific bit
    layout of the packed codes would allow (three words by one shift and one AND, the fourth by
    three of each, plus the four HMUL2). The operands keep the usual layout, so it only times
    the instruction count."""
    cheaper = """@cute.jit
def decode8(x: Uint32, sc: Uint32, hi: cutlass.Constexpr[bool]):
    m = Uint32(MAG_BITS | SIGN_BITS)
    w3 = ((x >> Uint32(4)) & Uint32(0x00C000C0)) | ((x >> Uint32(5)) & Uint32(0x01000100))
    w3 = w3 | ((x << Uint32(1)) & Uint32(SIGN_BITS))
    return (
        mul_bf16x2_bcast(x & m, sc, hi),
        mul_bf16x2_bcast((x << Uint32(3)) & m, sc, hi),
        mul_bf16x2_bcast((x << Uint32(6)) & m, sc, hi),
        mul_bf16x2_bcast(w3, sc, hi),
    )
"""
    return _local_decode8(src, cheaper)


def passthrough_decode(src: str) -> str:
    """The small-M kernels' decode of A (bytes) and B (packed) replaced by the code words
    themselves (one XOR keeps the scale's load): the mma run on undecoded operands."""
    src = _local_decode8(
        src,
        "@cute.jit\ndef decode8_bytes(lo: Uint32, hi_codes: Uint32, sc: Uint32, "
        "hi: cutlass.Constexpr[bool]):\n    return (lo, hi_codes ^ sc, lo, hi_codes)\n",
        "from fp4gen.kernels.gemm_sm90_small import decode8_bytes_",
    )
    return _local_decode8(
        src,
        "@cute.jit\ndef decode8(x: Uint32, sc: Uint32, hi: cutlass.Constexpr[bool]):\n"
        "    return (x, x ^ sc, x, x)\n",
    )


def decoded_b_rows(rows: int) -> Patch:
    """Decode A and only the first ``rows`` rows of B's tile (B row r sits at r * 128 bytes)."""

    def patch(src: str) -> str:
        return _replace_once(
            src,
            "            if valid[i]:\n                dst = cutlass.select_(",
            f"            if valid[i] & (is_a[i] | (dst_off[i] < {rows * 128})):\n"
            "                dst = cutlass.select_(",
        )

    return patch


LARGE = TILES["large"]
VARIANTS: dict[str, list[Patch]] = {
    "full": [],
    "no-fence": [drop_fence],
    "no-decode": [drop_decode],
    "no-decode-no-fence": [drop_decode, drop_fence],
    "decode-no-store": [decode_no_store],
    "store-no-decode": [store_no_decode],
    "fewer-decode-ops": [fewer_decode_ops],
    "a-only": [decoded_b_rows(0)],
    "half-b": [decoded_b_rows(LARGE.tile_n // 2)],
    "quarter-b": [decoded_b_rows(LARGE.tile_n // 4)],
}
# the small-M kernels (--tile r16, r32, r64): decode in registers, nothing to store or fence
SMALL_VARIANTS: dict[str, list[Patch]] = {
    "full": [],
    "no-decode": [passthrough_decode],
    "fewer-decode-ops": [fewer_decode_ops],
}


def variants_of(tile_name: str) -> dict[str, list[Patch]]:
    if tile_name not in TILES:
        raise SystemExit(f"unknown tile {tile_name!r}; tiles: {', '.join(TILES)}")
    return SMALL_VARIANTS if isinstance(TILES[tile_name], SmallMTile) else VARIANTS


def variant_source(name: str, tile_name: str = "large") -> str:
    """The generated NVFP4 GEMM module of tile ``tile_name`` with variant ``name``'s patches."""
    variants = variants_of(tile_name)
    if name not in variants:
        raise SystemExit(
            f"unknown variant {name!r} for tile {tile_name}; variants: {', '.join(variants)}"
        )
    nvfp4 = BUILTIN_FORMATS["nvfp4"]
    tile = TILES[tile_name]
    spec = gemm_spec(nvfp4, nvfp4.with_block((16, 16)), 8192, out_dtype="bf16", tile=tile)
    src = render_gemm(spec)
    if not isinstance(tile, SmallMTile):  # the wgmma kernel's body is in its class's module
        src = with_kernel_class(src)
    for patch in variants[name]:
        src = patch(src)
    return src


def load_variant(name: str, workdir: Path, tile_name: str = "large") -> ModuleType:
    module_name = f"ablation_{tile_name}_" + name.replace("-", "_")
    path = workdir / f"{module_name}.py"
    path.write_text(variant_source(name, tile_name))
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses (the kernel's params) look their module up
    spec.loader.exec_module(module)
    return module


def operands(m: int, n: int, k: int, small: bool, g: torch.Generator) -> tuple:
    """Random codes (A one per byte for the small-M kernels, else packed; B packed), scale codes
    of 1.0, global scales 1, in the modules' launch_args order."""
    if small:
        a = torch.randint(0, 16, (m, k), generator=g, device="cuda", dtype=torch.uint8)
    else:
        a = torch.randint(0, 256, (m, k // 2), generator=g, device="cuda", dtype=torch.uint8)
    b = torch.randint(0, 256, (n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
    sa = torch.full((m, k // 16), ONE_E4M3, device="cuda", dtype=torch.uint8)
    sb = torch.full((-(-n // 16), k // 16), ONE_E4M3, device="cuda", dtype=torch.uint8)
    one = torch.ones(1, device="cuda")
    return a, sa, one, b, sb, one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tile",
        default="large",
        help="a tile of fp4gen.codegen.gemm.TILES: large (default; wgmma) or r16, r32, r64 "
        "(the small-M kernels, variants full, no-decode, fewer-decode-ops)",
    )
    ap.add_argument("--shape", default="", help="MxNxK (default 8192^3, 16x8192x8192 small-M)")
    ap.add_argument("--variants", default="", help="comma-separated (default: all of the tile)")
    ap.add_argument("--iters", type=int, default=20, help="calls per timed run (default 20)")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="patch and cross-compile every variant for sm_90a (no GPU needed), then stop",
    )
    args = ap.parse_args()
    small = isinstance(TILES.get(args.tile), SmallMTile)
    names = [v for v in args.variants.split(",") if v] or list(variants_of(args.tile))
    with tempfile.TemporaryDirectory(prefix="fp4gen_ablation_") as tmp:
        modules = {name: load_variant(name, Path(tmp), args.tile) for name in names}
        if args.compile_only:
            for name, module in modules.items():
                t0 = time.perf_counter()
                module.compile_kernel("gemm", "sm_90a")
                print(
                    f"{args.tile} {name}: compiled for sm_90a in {time.perf_counter() - t0:.1f} s"
                )
            return 0
        if not torch.cuda.is_available():
            raise SystemExit("timing needs a CUDA GPU (sm_90); --compile-only does not")
        shape = args.shape or ("16x8192x8192" if small else "8192x8192x8192")
        m, n, k = (int(v) for v in shape.lower().split("x"))
        flop = 2 * m * n * k
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        g = torch.Generator(device="cuda").manual_seed(0)
        # enough sets that B (N x K / 2 bytes each) is not found in L2 by the next call
        sets = [operands(m, n, k, small, g) for _ in range(4 if small else 2)]
        bf16 = [
            (
                torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(2)
        ]
        t_cublas = bench(lambda i: torch.matmul(bf16[i % 2][0], bf16[i % 2][1].t()), args.iters)
        label = f"{shape} {args.tile}"
        print(
            f"{shape} cuBLAS bf16 torch.matmul {t_cublas * 1e6:9.1f} us "
            f"{flop / t_cublas / 1e12:6.1f} TFLOP/s",
            flush=True,
        )
        extra: dict = {}
        if small:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            splits = choose_splits(TILES[args.tile], m, n, k, sms)
            extra = {"splits": splits}
        t_full = None
        for name, module in modules.items():
            fn = module.compile_kernel("gemm", "sm_90a")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            if small:
                extra["ws"] = module.workspace(m, n, extra["splits"], "cuda")
            calls = [module.launch_args(*s, k=k, out=out, **extra) for s in sets]
            t = bench(lambda i, fn=fn, calls=calls: fn(*calls[i % len(calls)]), args.iters)
            if name == "full":
                t_full = t
            vs_full = f"  x{t_full / t:5.2f} full" if t_full is not None else ""
            print(
                f"{label} {name:22s} {t * 1e6:9.1f} us {flop / t / 1e12:6.1f} TFLOP/s  "
                f"x{t_cublas / t:5.2f} cuBLAS{vs_full}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
