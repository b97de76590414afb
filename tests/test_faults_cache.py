"""Faults of ``fp4gen cache`` and ``fp4gen compile`` (CPU only, no compile workers): clear
touches only a marked cache's own entries, --json is strict JSON, recipe and kernel names never
lead out of their folder, unusable folders are one line on stderr with exit 1, and --jobs takes
only whole numbers of at least 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4gen.cli import main
from fp4gen.compiler import cache as cache_mod
from fp4gen.compiler import commands, jit
from fp4gen.compiler.build import compile_recipes
from fp4gen.compiler.cache import MARKER, CacheError, KernelCache, inside
from fp4gen.dsl import load_recipe
from fp4gen.errors import FP4GenError

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

sys.path.insert(0, str(TESTS))
from kernel_stub import render_stub  # noqa: E402

sys.path.remove(str(TESTS))

RECIPE_BODY = "operands {\n    * : mxfp8_e4m3 round nearest\n}\n"
PLAIN_RULE = (
    "must be a plain name (letters, digits, '_', '-', '.'; not '.' or '..'; no path separators)"
)
REFUSAL = (
    "fp4gen cache: refusing to clear {root}: it has no .fp4gen-cache marker, so it is not known "
    "to be an fp4gen cache and may hold other files; point FP4GEN_CACHE_DIR or --cache-dir at a "
    "dedicated folder, or delete its v1/ and cute-dsl/ folders by hand"
)


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test reads or writes the real cache or the checkout (relative paths land in
    tmp_path); the stub template renders (no CuTe DSL)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FP4GEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(jit, "render_source", render_stub)
    monkeypatch.setattr(cache_mod, "template_version", lambda: "stub")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    """The single stderr line of an error (and no traceback)."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def strict_json(text: str) -> dict:
    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=no_constants)


def snapshot(folder: Path) -> dict[str, object]:
    """Every path under ``folder`` with its content (files), target (links) or "dir"."""
    out: dict[str, object] = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(top) / name
            rel = str(path.relative_to(folder))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = path.read_bytes()
    return out


def regular_bytes(folder: Path) -> int:
    return sum(
        (Path(top) / f).lstat().st_size
        for top, _, files in os.walk(folder)
        for f in files
        if not (Path(top) / f).is_symlink()
    )


def fake_build(folder: Path) -> dict:
    (folder / "kernel.so").write_bytes(b"\x7fELF" + b"k" * 3000)
    return {"symbol": "fp4gen_test"}


def filled_cache(root: Path) -> KernelCache:
    """A cache with a source, two kernel entries, a lock and the DSL's own files."""
    cache = KernelCache(root)
    cache.store_source("A = 1\n")
    for arch in ("sm_90a", "sm_100a"):
        key, parts = cache.key(source_sha256="s", kernel="k", arch=arch)
        cache.get_or_build(key, fake_build, parts=parts)
    (cache.dsl_cache_dir / "sub").mkdir(parents=True)
    (cache.dsl_cache_dir / "sub" / "blob.bin").write_bytes(b"d" * 777)
    return cache


def write_recipe(path: Path, name: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'recipe {json.dumps(name)} "t"\n{RECIPE_BODY}')
    return path


# ----------------------------------------------------------------------------------------------
# 1. cache clear removes only what fp4gen wrote, from a marked folder
# ----------------------------------------------------------------------------------------------


def test_clear_refuses_a_folder_without_the_marker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    user = tmp_path / "user"
    (user / "photos").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    (user / "photos" / "a.jpg").write_bytes(b"\xff\xd8" * 100)
    # even names that look like cache entries stay: the folder is not known to be a cache
    (user / "v1" / "sources").mkdir(parents=True)
    (user / "v1" / "sources" / ("a" * 64 + ".py")).write_text("X = 1\n")
    before = snapshot(tmp_path)
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(user))

    code, out, err = run(capsys, "cache", "clear")
    assert code == 1 and out == ""
    assert one_line(err) == REFUSAL.format(root=user)

    code, out, err = run(capsys, "cache", "clear", "--json")
    assert code == 1
    assert strict_json(out) == {"location": str(user), "error": REFUSAL.format(root=user)[14:]}
    assert one_line(err) == REFUSAL.format(root=user)
    assert snapshot(tmp_path) == before


def test_info_on_an_unmarked_and_on_a_missing_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "big.dat").write_bytes(b"x" * 5000)
    code, out, _ = run(capsys, "cache", "info", "--cache-dir", str(user))
    assert code == 0
    assert f"status     no {MARKER} marker: not known to be an fp4gen cache" in out
    assert "size       0 B" in out  # user files are not the cache's size
    code, out, _ = run(capsys, "cache", "info", "--json", "--cache-dir", str(user))
    info = strict_json(out)
    assert code == 0 and info["exists"] is True and info["marked"] is False
    assert info["bytes"] == 0 and info["kernels"] == 0

    missing = tmp_path / "none"
    code, out, _ = run(capsys, "cache", "info", "--cache-dir", str(missing))
    assert code == 0 and "status     not created yet" in out
    code, out, _ = run(capsys, "cache", "info", "--json", "--cache-dir", str(missing))
    info = strict_json(out)
    assert (info["exists"], info["marked"], info["kernels"], info["bytes"]) == (False, False, 0, 0)
    code, out, err = run(capsys, "cache", "clear", "--json", "--cache-dir", str(missing))
    assert code == 0 and err == ""
    assert strict_json(out) == {"location": str(missing), "existed": False, "freed_bytes": 0}
    code, out, _ = run(capsys, "cache", "clear", "--cache-dir", str(missing))
    assert code == 0 and out == f"nothing to clear: {missing} does not exist\n"
    assert not missing.exists()  # looking is not creating


def test_first_write_marks_the_root(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "c")
    assert not cache.marked
    cache.store_source("A = 1\n")
    assert cache.marked and (tmp_path / "c" / MARKER).is_file()


def test_clear_keeps_user_files_in_a_marked_root_and_reports_the_bytes_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "c"
    cache = filled_cache(root)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"o" * 999)
    before_user = snapshot(outside)
    entry_bytes = regular_bytes(root) - (root / MARKER).stat().st_size
    # user files beside and inside the layout, and a link named like an entry
    user_files = {
        root / "notes.txt": b"n" * 123,
        root / "v1" / "README": b"r" * 45,
        root / "v1" / "sources" / "mine.py": b"m" * 67,
        root / "v1" / "kernels" / "mine" / "entry.json": b"{}",
        root / "v1" / "extra" / "f": b"e" * 8,
    }
    for path, data in user_files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "v1" / "kernels" / ("f" * 40)).symlink_to(outside, target_is_directory=True)

    code, out, err = run(capsys, "cache", "info", "--json", "--cache-dir", str(root))
    info = strict_json(out)
    assert code == 0 and info["marked"] is True and info["kernels"] == 2
    assert info["bytes"] == entry_bytes  # what clear would free: entries only

    code, out, err = run(capsys, "cache", "clear", "--json", "--cache-dir", str(root))
    assert code == 0 and err == ""
    assert strict_json(out) == {"location": str(root), "existed": True, "freed_bytes": entry_bytes}
    for path, data in user_files.items():
        assert path.read_bytes() == data
    assert (root / MARKER).is_file()
    assert snapshot(outside) == before_user  # the link was not followed
    assert not cache.dsl_cache_dir.exists() and not (root / "v1" / "locks").exists()
    assert not cache.entries() and cache.info()["bytes"] == 0
    kept = sum(map(len, user_files.values())) + (root / MARKER).stat().st_size
    assert regular_bytes(root) == kept

    # the text report names the exact bytes too
    filled_cache(root)
    entry_bytes = regular_bytes(root) - kept
    code, out, _ = run(capsys, "cache", "clear", "--cache-dir", str(root))
    assert code == 0 and out.startswith(f"cleared {root} (") and f", {entry_bytes} bytes)" in out


def test_clear_through_xdg_cache_home_leaves_siblings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    xdg = tmp_path / "xdg"
    filled_cache(xdg / "fp4gen")
    (xdg / "other-app").mkdir()
    (xdg / "other-app" / "data").write_text("theirs")
    code, out, err = run(capsys, "cache", "clear")
    assert code == 0, err
    assert out.startswith(f"cleared {xdg / 'fp4gen'} (")
    assert (xdg / "other-app" / "data").read_text() == "theirs"
    assert KernelCache().info()["kernels"] == 0


# ----------------------------------------------------------------------------------------------
# 2. --json is strict JSON for every cache subcommand
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["info", "clear"])
def test_cache_json_is_strict_json(
    action: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    filled_cache(tmp_path / "c")
    code, out, err = run(capsys, "cache", action, "--json", "--cache-dir", str(tmp_path / "c"))
    assert code == 0 and err == ""
    data = strict_json(out)
    assert data["location"] == str(tmp_path / "c")
    assert ("toolchain" in data) == (action == "info")


# ----------------------------------------------------------------------------------------------
# 3. names that become paths stay inside their folder
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "..", ".", "a/b", "ab cd", "ABSOLUTE"])
def test_recipe_name_used_as_a_folder_must_be_plain(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "manifest.json").write_text('{"mine": true}\n')
    if name == "ABSOLUTE":
        name = str(victim)
    work = tmp_path / "work" / "a"
    recipe = write_recipe(work / "r.fp4r", name)
    (tmp_path / "work" / "x").mkdir()
    (tmp_path / "work" / "x" / "manifest.json").write_text('{"theirs": true}\n')
    before = snapshot(tmp_path)
    monkeypatch.chdir(work)
    message = (
        f"fp4gen compile: {recipe}: recipe name {name!r} is used as a folder name, so it "
        f"{PLAIN_RULE}; rename the recipe, or compile it alone with --out DIR"
    )
    # the default folder generated/<recipe>/, and one folder per recipe under --out
    other = write_recipe(tmp_path / "o.fp4r", "ok")
    for argv in (
        [str(recipe)],
        [str(recipe), str(other), "--out", str(tmp_path / "out")],
    ):
        code, out, err = run(
            capsys, "compile", *argv, "--no-compile", "--cache-dir", str(tmp_path / "c")
        )
        assert code == 1 and out == ""
        assert one_line(err) == message
    assert snapshot(tmp_path) == {**before, "o.fp4r": other.read_bytes()}


def test_single_recipe_with_out_uses_no_name_as_a_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = write_recipe(tmp_path / "r.fp4r", "../../x")
    out = tmp_path / "out"
    code, stdout, err = run(
        capsys, "compile", str(recipe), "--out", str(out), "--no-compile",
        "--cache-dir", str(tmp_path / "c"),
    )  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["recipe"]["name"] == "../../x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "out", "r.fp4r"]


def test_an_edited_manifest_cannot_delete_files_outside_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = write_recipe(tmp_path / "r.fp4r", "r")
    out = tmp_path / "out"
    argv = ["compile", str(recipe), "--out", str(out), "--no-compile"]
    argv += ["--cache-dir", str(tmp_path / "c")]
    (tmp_path / "victim.py").write_text("keep")
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    m = json.loads((out / "manifest.json").read_text())
    m["kernels"] += [{"file": "../victim.py"}, {"file": str(tmp_path / "victim.py")}]
    (out / "manifest.json").write_text(json.dumps(m))
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    assert (tmp_path / "victim.py").read_text() == "keep"


def test_paths_from_names_are_checked(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    assert inside(folder, "ptx", "sm_90a", "k") == folder / "ptx" / "sm_90a" / "k"
    for bad in ("../x.py", "/abs.py", "..", "a\\b"):
        with pytest.raises(FP4GenError, match="must be a plain name"):
            inside(folder, bad)
    (folder / "link").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(FP4GenError, match="leads out of"):
        inside(folder, "link")
    cache = KernelCache(tmp_path / "c")
    for key in ("../../x", "/abs", "A" * 40, "a" * 39):
        with pytest.raises(CacheError, match="is not a kernel cache key"):
            cache.entry_path(key)
        with pytest.raises(CacheError, match="is not a kernel cache key"), cache.lock(key):
            pass
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------------
# 4. unusable folders: one line naming the path, exit 1, no traceback
# ----------------------------------------------------------------------------------------------


def test_file_typed_cache_dir_and_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = write_recipe(tmp_path / "r.fp4r", "r")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    good = tmp_path / "good"
    before = snapshot(tmp_path)

    def cache_msg(path: Path) -> str:
        return (
            f"fp4gen compile: cannot use the kernel cache {path}: {blocker} is a file, not a "
            "folder (point FP4GEN_CACHE_DIR or --cache-dir at a writable folder)"
        )

    def out_msg(path: Path) -> str:
        return (
            f"fp4gen compile: cannot write the output folder {path}: {blocker} is a file, not a "
            "folder (choose another --out)"
        )

    cases = [
        (["--cache-dir", str(blocker), "--out", str(good)], cache_msg(blocker)),
        (["--cache-dir", str(blocker / "c"), "--out", str(good)], cache_msg(blocker / "c")),
        (["--cache-dir", str(good), "--out", str(blocker)], out_msg(blocker)),
        (["--cache-dir", str(good), "--out", str(blocker / "o")], out_msg(blocker / "o")),
    ]
    for extra, message in cases:
        code, out, err = run(capsys, "compile", str(recipe), "--no-compile", *extra)
        assert code == 1 and out == ""
        assert one_line(err) == message
        if "--out" in extra and extra[extra.index("--out") + 1] == str(good):
            assert not good.exists()  # the cache is checked before any output is written
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("good")} == before

    for action in ("info", "clear"):
        for path in (blocker, blocker / "c"):
            code, out, err = run(capsys, "cache", action, "--json", "--cache-dir", str(path))
            assert code == 1
            line = one_line(err)
            assert line.startswith("fp4gen cache: cannot ") and str(path) in line
            assert f"{blocker} is a file, not a folder" in line
            assert strict_json(out)["error"] == line.removeprefix("fp4gen cache: ")
    assert blocker.read_text() == "not a folder"


def test_file_typed_cache_dir_through_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "home").write_text("HOME is a file")
    monkeypatch.delenv("XDG_CACHE_HOME")
    recipe = write_recipe(tmp_path / "r.fp4r", "r")
    root = tmp_path / "home" / ".cache" / "fp4gen"
    code, out, err = run(capsys, "compile", str(recipe), "--no-compile", "--out", "o")
    assert code == 1
    assert one_line(err) == (
        f"fp4gen compile: cannot use the kernel cache {root}: {tmp_path / 'home'} is a file, "
        "not a folder (point FP4GEN_CACHE_DIR or --cache-dir at a writable folder)"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_read_only_cache_dir_and_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = write_recipe(tmp_path / "r.fp4r", "r")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        for extra, message in (
            (
                ["--cache-dir", str(locked / "c"), "--out", str(tmp_path / "o")],
                f"fp4gen compile: cannot use the kernel cache {locked / 'c'}: "
                f"{locked / 'c'}: permission denied",
            ),
            (
                ["--cache-dir", str(tmp_path / "c"), "--out", str(locked / "o")],
                f"fp4gen compile: cannot write the output folder {locked / 'o'}: "
                f"{locked / 'o'}: permission denied",
            ),
        ):
            code, _, err = run(capsys, "compile", str(recipe), "--no-compile", *extra)
            assert code == 1
            assert one_line(err).startswith(message)
    finally:
        locked.chmod(0o700)


def test_main_turns_a_stray_os_error_into_one_line_and_keeps_bugs_visible(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(args: object) -> int:
        raise OSError(28, "No space left on device", "/some/where/kernel.so")

    monkeypatch.setattr(commands, "cmd_cache", disk_full)
    code, out, err = run(capsys, "cache", "info")
    assert code == 1 and out == ""
    assert one_line(err) == "fp4gen cache: /some/where/kernel.so: No space left on device"

    def bug(args: object) -> int:
        raise KeyError("a genuine bug")

    monkeypatch.setattr(commands, "cmd_cache", bug)
    with pytest.raises(KeyError, match="a genuine bug"):
        main(["cache", "info"])


def test_no_traceback_from_a_real_process(tmp_path: Path) -> None:
    """``python -m fp4gen``: the refusal, a bad recipe name and a file-typed --out."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "FP4GEN_CACHE_DIR": str(tmp_path / "user"),
    }
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    bad = write_recipe(tmp_path / "bad.fp4r", "../../x")
    runs = {
        "cache clear": (["cache", "clear"], REFUSAL.format(root=tmp_path / "user")),
        "recipe name": (["compile", str(bad), "--no-compile"], f"{bad}: recipe name '../../x'"),
        "out is a file": (
            ["compile", str(bad), "--out", str(tmp_path / "file" / "o"), "--no-compile"],
            f"cannot write the output folder {tmp_path / 'file' / 'o'}: {tmp_path / 'file'} is a "
            "file, not a folder",
        ),
    }  # fmt: skip
    for what, (argv, expected) in runs.items():
        proc = subprocess.run(
            [sys.executable, "-m", "fp4gen", *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 1, (what, proc.stderr)
        assert "Traceback" not in proc.stderr, what
        assert len(proc.stderr.strip().splitlines()) == 1, (what, proc.stderr)
        assert expected in proc.stderr, (what, proc.stderr)
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.fp4r", "file", "user"]


# ----------------------------------------------------------------------------------------------
# 5. --jobs takes a whole number of at least 1
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-3", "0", "two", "1.5"])
def test_jobs_must_be_at_least_one(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = write_recipe(tmp_path / "r.fp4r", "r")
    with pytest.raises(SystemExit) as exc:
        main(["compile", str(recipe), "--jobs", value, "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"fp4gen compile: error: argument --jobs/-j: expected a whole number of at least 1, "
        f"got {value!r}"
    ) in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="jobs must be at least 1, got 0"):
        compile_recipes([load_recipe(recipe)], jobs=0, compile=False, out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_cache_dir_setting_with_an_unknown_home_is_one_line(monkeypatch, capsys) -> None:
    from fp4gen.cli import main

    monkeypatch.setenv("FP4GEN_CACHE_DIR", "~nosuchuser-fp4gen/x")
    assert main(["cache", "info"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "fp4gen cache: FP4GEN_CACHE_DIR=~nosuchuser-fp4gen/x: cannot expand its '~': "
        "no home folder for that user\n"
    )
