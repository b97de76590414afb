"""Compile and load times of a recipe's kernels, and the host overhead of calling them.

    python benchmarks/kernel_cache.py [--recipe recipes/nvfp4.fp4r] [--arch sm_90a] [--jobs N]
                                      [--overhead] [--json OUT]

1. cold: ``fp4gen compile RECIPE`` into an empty cache (its own folder, the DSL's file cache in
   it too), for sm_90a and sm_100a, in worker processes; wall time and summed compile seconds;
2. warm: the same command again (every kernel found in the cache, no worker started);
3. load: a fresh process calls ``fp4gen.runtime.kernels_for`` for every kernel of the recipe for
   ``--arch`` (import time and kernels_for time separately; no GPU needed to load);
4. with ``--overhead`` (CUDA GPU): host time per call of the NVFP4 rowwise kernels on a small
   tensor: one TVM-FFI function call with preallocated outputs, the module's ``run`` (allocations
   + two launches), ``quantize(backend="cute")`` (checks + run + QuantizedTensor) and a memoized
   ``kernels_for`` lookup. Calls are issued back to back and synchronized once, so the time per
   call is the host's as long as the GPU keeps up (the kernels take a few microseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

COMPILED = re.compile(r" compiled\s+([0-9.]+)s$", re.MULTILINE)
CACHED = re.compile(r" cached$", re.MULTILINE)
ROOT = Path(__file__).resolve().parent.parent

LOAD = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import torch, cutlass
    from fp4gen.compiler.build import render_plan
    from fp4gen.compiler.plan import plan_recipe
    from fp4gen.dsl import load_recipe
    from fp4gen.runtime import kernels_for
    t1 = time.perf_counter()
    specs = [k.planned.spec for k in render_plan(plan_recipe(load_recipe(sys.argv[1])))
             if k.source is not None]
    t2 = time.perf_counter()
    stats = [kernels_for(s, sys.argv[2]).stats for s in specs]
    t3 = time.perf_counter()
    print(json.dumps({"imports": t1 - t0, "plan_render": t2 - t1, "kernels_for": t3 - t2,
                      "specs": len(specs), "compiled": sum(s.compiled for s in stats),
                      "loaded": sum(s.loaded for s in stats)}))
    """
)

OVERHEAD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from fp4gen.formats import BUILTIN_FORMATS
    from fp4gen.runtime import cute_backend, kernels_for
    from fp4gen.runtime.quantize_dispatch import quantize

    fmt = BUILTIN_FORMATS["nvfp4"]
    spec = cute_backend.spec_for(fmt, "nearest", None, torch.bfloat16)
    k = kernels_for(spec)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    _, launches = k.module.launches(x)  # preallocated outputs: time the call alone
    name, call_args = launches[-1]
    fq = k[name]

    def per_call(fn, n):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    out = {
        "tvm_ffi_call_us": per_call(lambda: fq(*call_args), 5000),
        "run_us": per_call(lambda: k.run(x), 2000),
        "quantize_cute_us": per_call(lambda: quantize(x, fmt, backend="cute"), 1000),
        "quantize_reference_us": per_call(lambda: quantize(x, fmt, backend="reference"), 200),
        "kernels_for_memo_us": per_call(lambda: kernels_for(spec), 5000),
        "arch": k.arch,
    }
    print(json.dumps(out))
    """
)


def run_json(cmd: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "fp4gen" / "recipes" / "nvfp4.fp4r"))
    ap.add_argument("--arch", default="sm_90a", help="arch the load step loads (default sm_90a)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--overhead", action="store_true", help="measure call overhead (GPU)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="fp4gen-bench-") as tmp:
        env = {**os.environ, "FP4GEN_CACHE_DIR": str(Path(tmp) / "cache")}
        env["CUTE_DSL_CACHE_DIR"] = str(Path(tmp) / "cache" / "cute-dsl")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        compile_cmd = [sys.executable, "-m", "fp4gen", "compile", args.recipe]
        compile_cmd += ["--out", str(Path(tmp) / "out")]  # stand-ins included: what runs today
        if args.jobs:
            compile_cmd += ["--jobs", str(args.jobs)]
        for label in ("cold", "warm"):
            start = time.perf_counter()
            proc = subprocess.run(compile_cmd, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - start
            if proc.returncode != 0:
                sys.exit(proc.stderr[-4000:])
            # the manifest holds no timings (it is checked in): the command prints one line
            # per kernel and arch, "compiled  <seconds>s" or "cached"
            seconds = [float(m.group(1)) for m in COMPILED.finditer(proc.stdout)] + [
                0.0 for _ in CACHED.finditer(proc.stdout)
            ]
            results[f"compile_{label}"] = {
                "wall_s": round(wall, 2),
                "kernels": len(seconds),
                "sum_compile_s": round(sum(seconds), 2) if label == "cold" else None,
                "summary": proc.stdout.strip().splitlines()[-1],
            }
        results["load"] = run_json([sys.executable, "-c", LOAD, args.recipe, args.arch], env)
        if args.overhead:
            results["overhead"] = run_json([sys.executable, "-c", OVERHEAD], env)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
