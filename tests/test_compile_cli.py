"""``fp4gen compile`` and ``fp4gen cache`` (CPU only: cross-compiles for sm_90a and sm_100a).

Most tests use the stub template of ``kernel_stub`` (kernels that compile in a fraction of a
second, supporting single rowwise quantize outputs like the real template; no GEMM or dequantize
kernels, which are then listed as unsupported); one compiles a quantize kernel with the real
template when it can generate it. tests/test_aot.py compiles a recipe's GEMM kernels for real.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from fp4gen.cli import main
from fp4gen.compiler import cache as cache_mod
from fp4gen.compiler import jit
from fp4gen.compiler.build import recipe_sha256
from fp4gen.compiler.cache import KernelCache
from fp4gen.dsl import load_recipe
from fp4gen.spec import QuantKernelSpec, QuantOutput

TESTS = Path(__file__).resolve().parent
RECIPES = TESTS.parent / "fp4gen" / "recipes"
NVFP4 = str(RECIPES / "nvfp4.fp4r")

sys.path.insert(0, str(TESTS))
from kernel_stub import render_stub  # noqa: E402

sys.path.remove(str(TESTS))


def no_gemm_template(spec: object) -> str:
    raise NotImplementedError(f"{spec.name}: no GEMM or dequantize template here (stub)")  # type: ignore[attr-defined]


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stub template, with a pinned template version (the real one may change meanwhile);
    the GEMM-side kernels are left unsupported (tests/test_aot.py compiles them)."""
    monkeypatch.setattr(jit, "render_source", render_stub)
    monkeypatch.setattr(jit, "render_gemm_source", no_gemm_template)
    monkeypatch.setattr(cache_mod, "template_version", lambda: "stub")


def built(stdout: str) -> dict[tuple[str, str, str], str]:
    """The printed compile results: (module, kernel, arch) -> "compiled  1.23s" or "cached"."""
    rows = {}
    for line in stdout.split("built (kernel, arch, result, compile seconds):\n", 1)[1].splitlines():
        if not line.startswith("  "):
            break
        module, kernel, arch, result = line.split(maxsplit=3)
        rows[(module, kernel, arch)] = result
    return rows


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def by_name(m: dict) -> dict[str, dict]:
    return {k["name"]: k for k in m["kernels"]}


X_ROW = "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne"
X_COL = "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_rht16"
DY_ROW = "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8"
DY_COL = "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_rht16"
FUSED = {
    "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_col_rne_rht16": [X_ROW, X_COL],
    "quant_e2m1_16x16_e4m3rn_g_bf16_row_rne_col_rne": [],
    "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16": [DY_ROW, DY_COL],
}


def test_compile_nvfp4_for_both_archs(
    stub: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, cache_dir = tmp_path / "out", tmp_path / "cache"
    argv = ["compile", NVFP4, "--arch", "sm_90a,sm_100a", "--out", str(out)]
    argv += ["--cache-dir", str(cache_dir), "--jobs", "2"]
    code, stdout, stderr = run(capsys, *argv)
    assert code == 0, stderr
    assert (
        "quantize plan: 3 planned kernel(s), 0 generated, 3 unsupported, "
        "4 single-output stand-in(s)" in stdout
    )
    assert f"nvfp4: wrote {out / 'manifest.json'}" in stdout
    assert "compiled 16 kernel(s), 0 from the cache, for sm_90a, sm_100a" in stdout
    # the plan: the GEMMs and what runs them, what is left to run time
    assert "fprop  A = x (nvfp4 1x16), B = W (nvfp4 16x16)" in stdout
    assert "left to run time (not compiled here):" in stdout
    # progress: not a terminal, so one line per compiled kernel (4 stand-ins x 2 kernels x 2)
    progress = [line for line in stderr.splitlines() if re.match(r"\[\s*\d+/16\] ", line)]
    assert len(progress) == 16
    assert {line.split("] ")[1].split()[0] for line in progress} == {"sm_90a", "sm_100a"}
    # each unsupported kernel reported once
    for name in FUSED:
        assert stderr.count(f"{name}:") == 1
    assert "Traceback" not in stderr
    # every compiled kernel printed with its arch and seconds
    rows = built(stdout)
    assert len(rows) == 16
    for (module, kernel, arch), result in rows.items():
        assert module in (X_ROW, X_COL, DY_ROW, DY_COL) and kernel in ("amax", "quantize")
        assert arch in ("sm_90a", "sm_100a") and re.fullmatch(r"compiled\s+\d+\.\d\ds", result)

    m = manifest(out)
    assert m["format"] == 2
    recipe = load_recipe(Path(NVFP4))
    assert m["recipe"] == {
        "name": "nvfp4",
        "description": recipe.description,
        "file": "nvfp4.fp4r",
        "sha256": recipe_sha256(recipe),
    }
    assert m["arch"] == ["sm_90a", "sm_100a"]
    assert m["nvidia_cutlass_dsl"] == cache_mod.cutlass_dsl_version()
    assert m["template_version"] == "stub"
    assert m["input_dtypes"] == {"activation": "bf16", "weight": "bf16", "gradient": "bf16"}
    kernels = by_name(m)
    assert list(kernels)[:7] == [
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_col_rne_rht16",
        X_ROW,
        X_COL,
        "quant_e2m1_16x16_e4m3rn_g_bf16_row_rne_col_rne",
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16",
        DY_ROW,
        DY_COL,
    ]
    # then what the runtime loads besides: the stub makes none of it
    rest = list(kernels.values())[7:]
    assert [k["kind"] for k in rest[:2]] == ["quantize", "quantize"]
    assert {k["kind"] for k in rest[2:]} == {"dequant", "gemm_sm90", "gemm_sm100"}
    assert all(k["status"].startswith("unsupported: ") and k["file"] is None for k in rest)
    for name, stand_ins in FUSED.items():
        k = kernels[name]
        assert k["status"].startswith("unsupported: ") and "rowwise" in k["status"]
        assert k["file"] is None
        assert k.get("fallback", []) == stand_ins
        for s in stand_ins:
            assert kernels[s]["fallback_for"] == name
    x = kernels["quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_col_rne_rht16"]
    assert x["kind"] == "quantize" and x["tensors"] == ["x"]
    assert x["spec"]["element"] == "e2m1" and x["spec"]["block"] == "1x16"
    assert x["spec"]["scale"] == {"format": "e4m3", "rounding": "nearest"}
    assert x["spec"]["global_scale"] is True and x["spec"]["input_dtype"] == "bf16"
    assert [(o["direction"], o["rounding"]) for o in x["spec"]["outputs"]] == [
        ("rowwise", "nearest"),
        ("columnwise", "nearest"),
    ]
    assert x["spec"]["outputs"][1]["rht"]["size"] == 16
    assert {u["operand"] for u in x["uses"]} == {"fprop.activation", "wgrad.activation"}
    assert [u["operand"] for u in kernels[X_COL]["uses"]] == ["wgrad.activation"]
    assert [u["operand"] for u in kernels[DY_ROW]["uses"]] == ["dgrad.gradient"]
    w = kernels["quant_e2m1_16x16_e4m3rn_g_bf16_row_rne_col_rne"]
    assert w["spec"]["block"] == "16x16" and w["tensors"] == ["W"]
    for name in (X_ROW, X_COL, DY_ROW, DY_COL):
        k = kernels[name]
        assert k["status"] == "ok" and k["kernels"] == ["amax", "quantize"]
        source = (out / k["file"]).read_text()
        assert f"SPEC_NAME = {name!r}" in source
        assert k["source_sha256"] == cache_mod.sha256_text(source)
        assert k["archs"] == ["sm_90a", "sm_100a"]
    # no compile results, timings or cache state in the manifest: they are printed
    text = (out / "manifest.json").read_text()
    assert '"seconds"' not in text and '"cached"' not in text and '"compile"' not in text
    assert [s["context"] for s in m["skipped"]] == [
        "layers: first 2 blocks : bf16",
        "layers: last 8 blocks : bf16",
        'layers: match "*lm_head" : bf16',
    ]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", *(f"{n}.py" for n in (X_ROW, X_COL, DY_ROW, DY_COL))]
    )  # no PTX, no cubin
    cache = KernelCache(cache_dir)
    assert cache.info()["kernels"] == 16 and cache.info()["by_arch"] == {"sm_100a": 8, "sm_90a": 8}

    # a second run finds everything in the cache, without starting a worker, and writes the
    # same bytes
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, stdout, stderr = run(capsys, *argv)
    assert code == 0
    assert "compiled 0 kernel(s), 16 from the cache" in stdout
    assert not re.search(r"\[\s*\d+/16\]", stderr)
    assert built(stdout)[(X_ROW, "amax", "sm_90a")] == "cached"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_no_compile_no_timings_and_stale_files(
    stub: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    (out).mkdir()
    code, stdout, _ = run(
        capsys, "compile", NVFP4, "--out", str(out), "--cache-dir", str(tmp_path / "c"),
        "--no-compile",
    )  # fmt: skip
    assert code == 0 and not re.search(r"^(compiled \d|built )", stdout, flags=re.M)
    m = manifest(out)
    assert all("compile" not in k for k in m["kernels"])
    assert m["arch"] == ["sm_90a", "sm_100a"]
    assert KernelCache(tmp_path / "c").info()["kernels"] == 0
    # a kernel file that an earlier plan made and this one does not is removed
    m["kernels"].append({"name": "old", "file": "old.py"})
    (out / "manifest.json").write_text(json.dumps(m))
    (out / "old.py").write_text("# stale")
    (out / "notes.txt").write_text("kept")
    code, _, _ = run(
        capsys, "compile", NVFP4, "--out", str(out), "--cache-dir", str(tmp_path / "c"),
        "--arch", "sm_100a", "--no-timings", "-j", "1",
    )  # fmt: skip
    assert code == 0
    assert not (out / "old.py").exists() and (out / "notes.txt").exists()
    kernels = by_name(manifest(out))
    assert kernels[X_ROW]["archs"] == ["sm_100a"]
    # --arch sm_100a: no sm_90a GEMM is planned
    assert not [k for k in kernels.values() if k["kind"] == "gemm_sm90"]


def test_keep_ptx(stub: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "r.fp4r"
    recipe.write_text('recipe r "r"\noperands {\n    * : mxfp8_e4m3 round nearest\n}\n')
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "compile", str(recipe), "--out", str(out), "--cache-dir", str(tmp_path / "c"),
        "--arch", "sm_90a", "--keep-ptx",
    )  # fmt: skip
    assert code == 0, err
    (stand_in,) = [k for k in manifest(out)["kernels"] if k.get("fallback_for")]
    ptx = list((out / "ptx" / "sm_90a" / stand_in["name"] / "quantize").glob("*.ptx"))
    assert len(ptx) == 1 and ".target sm_90a" in ptx[0].read_text()


def test_mor_recipe_and_several_recipes(
    stub: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mor = str(RECIPES / "mor_tensor.fp4r")
    mxfp8 = str(RECIPES / "mxfp8.fp4r")
    code, stdout, _ = run(
        capsys, "compile", mor, mxfp8, "--out", str(tmp_path / "g"), "--no-compile",
        "--cache-dir", str(tmp_path / "c"),
    )  # fmt: skip
    assert code == 0
    assert "quantize plan: 1 planned kernel(s)" in stdout
    m = manifest(tmp_path / "g" / "mor_tensor")
    (k,) = m["kernels"]  # the GEMMs of MoR mixes run no GEMM kernel
    assert k["kind"] == "mor"
    assert k["spec"]["kind"] == "mor" and k["spec"]["rule"] == "tensor_e4m3"
    assert k["kernels"] == ["mor"] and len(k["uses"]) == 6
    assert (tmp_path / "g" / "mor_tensor" / k["file"]).is_file()
    assert m["skipped"] == []
    # mxfp8: one fused kernel for all tensors; its rowwise stand-in serves all six slots
    k = by_name(manifest(tmp_path / "g" / "mxfp8"))
    (stand_in,) = [v for v in k.values() if v.get("fallback_for")]
    assert len(stand_in["uses"]) == 6


def test_compile_errors(stub: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compile", NVFP4, "--arch", "sm_80"])
    assert exc.value.code == 2
    assert "--arch takes" in capsys.readouterr().err
    code, _, err = run(capsys, "compile", str(tmp_path / "missing.fp4r"))
    assert code == 1 and "missing.fp4r" in err


def test_cache_info_and_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = KernelCache(tmp_path / "c")
    cache.store_source("A = 1\n")
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_100a")
    cache.get_or_build(
        key, lambda f: (f / "kernel.so").write_bytes(b"x" * 2048) and {}, parts=parts
    )
    code, out, _ = run(capsys, "cache", "info", "--cache-dir", str(tmp_path / "c"))
    assert code == 0
    assert f"location   {tmp_path / 'c'}" in out
    assert "kernels    1 (sm_100a: 1)" in out and "sources    1" in out and "KiB" in out
    code, out, _ = run(capsys, "cache", "info", "--json", "--cache-dir", str(tmp_path / "c"))
    info = json.loads(out)
    assert info["kernels"] == 1 and info["toolchain"]["nvidia-cutlass-dsl"].startswith("4.8")
    code, out, _ = run(capsys, "cache", "clear", "--cache-dir", str(tmp_path / "c"))
    assert code == 0 and out.startswith(f"cleared {tmp_path / 'c'}")
    assert cache.info()["kernels"] == 0


def test_cache_commands_honour_fp4gen_cache_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "env"))
    code, out, _ = run(capsys, "cache", "info")
    assert code == 0 and f"location   {tmp_path / 'env'}" in out


def test_compile_with_the_real_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """mxfp8 (E4M3 1x32, UE8M0 scales): the real template's fused rowwise + columnwise kernel,
    both archs, with no stand-in (the runtime's other kernels are left out here: they are
    tests/test_aot.py's)."""
    from fp4gen.formats import E4M3, UE8M0, ScaleSpec

    single = QuantKernelSpec(
        E4M3,
        (1, 32),
        ScaleSpec(UE8M0, "up"),
        False,
        "bf16",
        (QuantOutput("rowwise", "nearest", None), QuantOutput("columnwise", "nearest", None)),
    )
    try:
        jit.render_source(single)
    except NotImplementedError as err:
        pytest.skip(f"the template cannot generate {single.name} yet: {err}")
    real = jit.render_source

    def planned_only(spec: object) -> str:
        if spec != single:
            raise NotImplementedError("not this test's kernel")
        return real(spec)  # type: ignore[arg-type]

    monkeypatch.setattr(jit, "render_source", planned_only)
    monkeypatch.setattr(jit, "render_gemm_source", no_gemm_template)
    out = tmp_path / "out"
    code, stdout, err = run(
        capsys, "compile", str(RECIPES / "mxfp8.fp4r"), "--out", str(out),
        "--cache-dir", str(tmp_path / "c"), "-j", "2",
    )  # fmt: skip
    assert code == 0, err
    kernels = by_name(manifest(out))
    assert [n for n, k in kernels.items() if k["status"] == "ok"] == [single.name]  # no stand-in
    k = kernels[single.name]
    assert k["kernels"] == ["quantize"] and k["archs"] == ["sm_90a", "sm_100a"]
    rows = built(stdout)
    for arch in ("sm_90a", "sm_100a"):
        assert rows[(single.name, "quantize", arch)].startswith("compiled")


# ----------------------------------------------------------------------------------------------
# --out: no writing through links, whole files, what was replaced
# ----------------------------------------------------------------------------------------------


def _compile_into(capsys: pytest.CaptureFixture[str], out: Path, cache: Path) -> tuple:
    return run(
        capsys, "compile", NVFP4, "--out", str(out), "--cache-dir", str(cache), "--no-compile"
    )


def test_compile_refuses_links_in_out(
    stub: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "users-notes.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").symlink_to(victim)
    code, _, err = _compile_into(capsys, out, tmp_path / "c")
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "manifest.json is a symbolic link" in err and "users-notes.txt" in err
    assert victim.read_text() == "precious"
    # a generated module's name as a link: refused before anything is written through it
    (out / "manifest.json").unlink()
    assert sorted(out.iterdir()) == []  # nothing was written
    (out / f"{X_ROW}.py").symlink_to(victim)
    code, _, err = _compile_into(capsys, out, tmp_path / "c")
    assert code == 1 and f"{X_ROW}.py is a symbolic link" in err
    assert victim.read_text() == "precious" and not (out / "manifest.json").exists()


def test_compile_says_which_files_it_replaced(
    stub: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text('{"mine": true, "kernels": [{"file": "keep.py"}]}\n')
    (out / "keep.py").write_text("# a user's file a foreign manifest names")
    code, stdout, err = _compile_into(capsys, out, tmp_path / "c")
    assert code == 0, err
    assert f"nvfp4: replaced 1 existing file(s) in {out}: manifest.json" in stdout
    assert manifest(out)["recipe"]["name"] == "nvfp4" and (out / "keep.py").is_file()
    # the same compile again changes nothing, so it replaces nothing
    code, stdout, _ = _compile_into(capsys, out, tmp_path / "c")
    assert code == 0 and "replaced" not in stdout


def test_compile_on_a_full_disk_leaves_no_partial_module(
    stub: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    from fp4gen import outputs

    out = tmp_path / "out"
    assert _compile_into(capsys, out, tmp_path / "c")[0] == 0
    module = out / f"{X_ROW}.py"
    room = module.stat().st_size // 2  # half the module fits, then the disk is full
    module.write_text("# the previous module\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(file, data: bytes) -> None:
        file.write(data[:room])
        if len(data) > room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs, "_write_data", full_disk)
    code, _, err = _compile_into(capsys, out, tmp_path / "c")
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"cannot write {module}: No space left on device" in err
    assert "previous file is unchanged" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no partial, no temp
