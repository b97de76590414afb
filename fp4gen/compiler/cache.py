"""Content-addressed on-disk cache of generated kernel sources and compiled kernels.

Layout (``root`` is $FP4GEN_CACHE_DIR, else $XDG_CACHE_HOME/fp4gen, else ~/.cache/fp4gen)::

    root/.fp4gen-cache              the marker: written on the first write, says "fp4gen's cache"
    root/v1/sources/<sha256>.py     generated module sources, named by the hash of their text
    root/v1/kernels/<key>/          one compiled kernel: kernel.so (+ kernel.o) and entry.json
    root/v1/locks/<key>.lock        one lock file per key (fcntl.flock)
    root/v1/tmp/                    staging: entries are built here, then renamed into place
    root/cute-dsl/                  the CuTe DSL's own file cache (CUTE_DSL_CACHE_DIR)

The key of a compiled kernel hashes everything that changes the binary: the source text, the
kernel name, the target arch, the compile options, and the toolchain (nvidia-cutlass-dsl, its
CUDA 12/13 library wheels and apache-tvm-ffi versions, the fp4gen template version, the host
platform, this layout's version).

Concurrency and crash safety: an entry is built in a private staging folder and published with
one ``rename``, so readers see a whole entry or none. Builders of one key take the key's lock
first, so a second process waits and then loads the first one's entry instead of compiling
again; without the lock (or if it fails) the rename still lets exactly one copy win and the loser
discards its own. Sources are written to a temp file and ``os.replace``d into place.

Clearing under a compile: a folder or source that vanishes while an entry is built (``fp4gen
cache clear`` in another shell) raises ``CacheVanished``; ``get_or_build`` then builds the entry
once more, and a second loss is reported as such (a compile worker's parent stores a lost source
again and asks once more, see ``fp4gen.compiler.build``).

Integrity: ``entry.json`` is written last and lists every file's size and sha256; an entry whose
files do not match (truncated, corrupt, half-deleted) is reported once per process as a warning,
removed and rebuilt.

Clearing: ``clear`` refuses a folder without the marker (a cache folder pointed at a folder of
other files must never lose them) and, in a marked folder, removes only what fp4gen writes: the
files and folders above whose names match their patterns, and ``cute-dsl/``. Anything else
(the marker included) stays.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from fp4gen.errors import FP4GenError
from fp4gen.outputs import (  # the rules of every command that writes (re-exported)
    PLAIN_NAME_RULE,
    file_in_the_way,
    inside,
    is_plain_name,
    path_problem,
)

log = logging.getLogger("fp4gen.cache")

LAYOUT_VERSION = "v1"
ENTRY_FILE = "entry.json"
MARKER = ".fp4gen-cache"
MARKER_TEXT = (
    "fp4gen kernel cache. 'fp4gen cache clear' removes only what fp4gen wrote here "
    f"({LAYOUT_VERSION}/ entries and cute-dsl/); other files stay.\n"
)
DSL_DIR = "cute-dsl"
# what fp4gen writes under root/v1/<folder>/: anything else there is not ours to delete
_OWNED_NAMES = {
    "sources": re.compile(r"[0-9a-f]{64}\.py|\.[0-9a-f]{64}\.py\..+\.tmp"),
    "kernels": re.compile(r"[0-9a-f]{40}"),
    "locks": re.compile(r"[0-9a-f]{40}\.lock"),
    "tmp": re.compile(r"[0-9a-f]{16}-.+|trash-.+|worker-.+\.log"),
}
_KEY = re.compile(r"[0-9a-f]{40}")
_warned: set[str] = set()


# ----------------------------------------------------------------------------------------------
# Location and toolchain
# ----------------------------------------------------------------------------------------------


def default_root() -> Path:
    """$FP4GEN_CACHE_DIR, else $XDG_CACHE_HOME/fp4gen, else ~/.cache/fp4gen."""
    env = os.environ.get("FP4GEN_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    return _root_for(env, xdg, os.environ.get("HOME"))


@lru_cache(maxsize=16)
def _root_for(env: str | None, xdg: str | None, home: str | None) -> Path:
    # remembered per environment (``home`` is in the key because Path.home() reads $HOME):
    # kernel lookups ask on every quantize call, and resolving the path costs more than the
    # lookup itself
    if env:
        return Path(env).expanduser()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fp4gen"


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


@lru_cache(maxsize=1)
def cutlass_dsl_version() -> str:
    return _dist_version("nvidia-cutlass-dsl")


@lru_cache(maxsize=1)
def tvm_ffi_version() -> str:
    return _dist_version("apache-tvm-ffi")


@lru_cache(maxsize=1)
def cutlass_dsl_libs() -> str:
    """The installed nvidia-cutlass-dsl-libs-* wheels (the CUDA 12 or 13 build of the compiler
    and runtime: their ptxas and runtime library make different binaries)."""
    from importlib import metadata

    names = set()
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("nvidia-cutlass-dsl-libs-"):
            names.add(f"{name.removeprefix('nvidia-cutlass-dsl-libs-')} {dist.version}")
    return ", ".join(sorted(names)) or "absent"


# what generated modules are made of (templates, their renderers) and import (the kernel
# classes: dequantize, GEMMs, the quantize, tile and MoR kernels and their device helpers): a
# change to any of these files is a new template version, so no cached kernel of the old code
# is loaded
_TEMPLATE_DIRS = ("templates", "codegen", "kernels")


@lru_cache(maxsize=1)
def template_version() -> str:
    """The quantize template's version: its declared TEMPLATE_VERSION (if any) and a hash of
    every file of fp4gen/templates, fp4gen/codegen and fp4gen/kernels (what generated modules
    are made of and import)."""
    import fp4gen

    pkg = Path(fp4gen.__file__).resolve().parent
    digest = hashlib.sha256()
    for folder in _TEMPLATE_DIRS:
        base = pkg / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(str(path.relative_to(pkg)).encode() + b"\0")
                digest.update(path.read_bytes() + b"\0")
    from fp4gen.codegen import quantize as codegen  # torch and Jinja: loaded when a key is made

    declared = str(getattr(codegen, "TEMPLATE_VERSION", "none"))
    return f"{declared}+{digest.hexdigest()[:16]}"


def toolchain(template: str | None = None) -> dict[str, str]:
    """The parts of every key that do not depend on the kernel."""
    from fp4gen import __version__

    return {
        "layout": LAYOUT_VERSION,
        "fp4gen": __version__,
        "template": template or template_version(),
        "nvidia-cutlass-dsl": cutlass_dsl_version(),
        "nvidia-cutlass-dsl-libs": cutlass_dsl_libs(),
        "apache-tvm-ffi": tvm_ffi_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
    }


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(message)


# ----------------------------------------------------------------------------------------------
# Sizes and removal, never following links (path rules: fp4gen.outputs)
# ----------------------------------------------------------------------------------------------


def _tree_size(path: Path) -> int:
    """Bytes of the regular files of ``path`` (a file or a folder), not following links."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size if stat.S_ISREG(st.st_mode) else 0
    total = 0
    for top, _dirs, files in os.walk(path):  # os.walk does not descend into linked folders
        for name in files:
            total += _tree_size(Path(top) / name)
    return total


def _unlink(path: Path) -> int:
    """Delete a file or link; the bytes this freed (0 for a link, or if it could not)."""
    try:
        st = path.lstat()
        path.unlink()
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _remove_tree(path: Path) -> int:
    """Delete a file or a folder, never following links out of it; the bytes actually freed."""
    if path.is_symlink() or not path.is_dir():
        return _unlink(path)
    freed = 0
    for top, dirs, files in os.walk(path, topdown=False):
        for name in files:
            freed += _unlink(Path(top) / name)
        for name in dirs:
            sub = Path(top) / name
            if sub.is_symlink():
                freed += _unlink(sub)
            else:
                with contextlib.suppress(OSError):
                    sub.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()
    return freed


# ----------------------------------------------------------------------------------------------
# Entries
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A valid compiled-kernel entry: its folder and its manifest (``entry.json``)."""

    key: str
    path: Path
    meta: Mapping[str, Any]

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(self.meta["files"])


class CacheError(FP4GenError, RuntimeError):
    """The cache folder cannot be used or cleared, or a key is malformed."""


class CacheVanished(CacheError):
    """A file or folder of the cache vanished while it was in use (the cache was cleared, or
    another process removed it meanwhile): worth one more try, then reported as such."""

    def __init__(self, message: str, path: Path) -> None:
        self.path = path
        super().__init__(message)


class SourceVanished(CacheVanished):
    """A generated source of the cache vanished before it was compiled: only who has its text
    (the compile's parent) can store it again, so ``get_or_build`` does not try again."""


# What a second loss adds to the message: the likely cause and what to do.
CLEARED_MEANWHILE = (
    "lost twice; was the kernel cache cleared during the compile? Compile again once it is not"
)


class KernelCache:
    """The on-disk cache. Cheap to construct; creates its folders on first write."""

    def __init__(
        self, root: str | os.PathLike[str] | None = None, *, template: str | None = None
    ) -> None:
        """``template`` pins the template version of the keys (default: ``template_version()``,
        for sources made by another renderer, e.g. in tests)."""
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.base = self.root / LAYOUT_VERSION
        self.template = template
        self._root_ready = False  # the root exists and carries the marker

    @property
    def template_version(self) -> str:
        """The template version in this cache's keys."""
        return self.template or template_version()

    # --- folders ----------------------------------------------------------------------------
    @property
    def sources_dir(self) -> Path:
        return self.base / "sources"

    @property
    def kernels_dir(self) -> Path:
        return self.base / "kernels"

    @property
    def dsl_cache_dir(self) -> Path:
        """Where the CuTe DSL keeps its own file cache (CUTE_DSL_CACHE_DIR) for our compiles."""
        return self.root / DSL_DIR

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @property
    def marked(self) -> bool:
        """Whether the root carries fp4gen's marker (only then may ``clear`` touch it)."""
        return self.marker.is_file()

    @contextlib.contextmanager
    def _writing(self, folder: Path) -> Iterator[None]:
        """Turn an OSError of writing into ``folder`` into a one-line CacheError."""
        try:
            yield
        except OSError as err:
            raise CacheError(
                f"cannot use the kernel cache {self.root}: {path_problem(folder, err)} "
                "(point FP4GEN_CACHE_DIR or --cache-dir at a writable folder)"
            ) from err

    def prepare(self) -> None:
        """Create the root and mark it as fp4gen's (once per instance; every write does it
        first). Raises CacheError, naming the path, where the root cannot be made or written."""
        if self._root_ready:
            return
        with self._writing(self.root):
            self.root.mkdir(parents=True, exist_ok=True)
            if not self.marked:
                _atomic_write(self.marker, MARKER_TEXT.encode())
        self._root_ready = True

    def _dir(self, name: str) -> Path:
        self.prepare()
        path = self.base / name
        with self._writing(path):
            path.mkdir(parents=True, exist_ok=True)
        return path

    def work_dir(self) -> Path:
        """The staging folder (created): entries in the making, compile worker logs."""
        return self._dir("tmp")

    # --- keys -------------------------------------------------------------------------------
    def key(
        self,
        *,
        source_sha256: str,
        kernel: str,
        arch: str,
        options: Mapping[str, Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """(key, the parts it hashes) for one kernel of one generated source on one arch."""
        parts = {
            "source": source_sha256,
            "kernel": kernel,
            "arch": arch,
            "options": dict(sorted((options or {}).items())),
            **toolchain(self.template),
        }
        blob = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:40], parts

    # --- sources ----------------------------------------------------------------------------
    def source_path(self, text: str) -> Path:
        return self.sources_dir / f"{sha256_text(text)}.py"

    def store_source(self, text: str) -> Path:
        """Write a generated source under its hash (idempotent, atomic); returns its path.

        A file there whose content does not hash to its name is replaced."""
        path = self.source_path(text)
        if path.is_file():
            try:
                if path.read_text() == text:
                    return path
            except (OSError, UnicodeDecodeError):
                pass
            _warn_once(str(path), f"fp4gen cache: corrupt source {path} is rewritten")
        folder = self._dir("sources")
        with self._writing(folder):
            _atomic_write(path, text.encode())
        return path

    # --- compiled kernels -------------------------------------------------------------------
    def entry_path(self, key: str) -> Path:
        return self.kernels_dir / _checked_key(key)

    def lookup(self, key: str) -> Entry | None:
        """The valid entry of ``key``, or None. An invalid entry is removed (warning once)."""
        path = self.entry_path(key)
        if not path.exists():
            return None
        problem = _verify(path)
        if problem is None:
            try:
                meta = json.loads((path / ENTRY_FILE).read_text())
            except (OSError, ValueError):  # removed or replaced since it was verified
                return None
            return Entry(key, path, meta)
        _warn_once(
            key,
            f"fp4gen cache: entry {path} is invalid ({problem}); removing it and rebuilding",
        )
        self._remove(path)
        return None

    def _remove(self, path: Path) -> None:
        """Remove a folder so that readers never see half of it: rename away, then delete."""
        trash = Path(tempfile.mkdtemp(prefix="trash-", dir=self._dir("tmp")))
        with contextlib.suppress(FileNotFoundError):  # someone else removed it
            os.rename(path, trash / "entry")
        shutil.rmtree(trash, ignore_errors=True)

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """An exclusive per-key lock across processes (released if the holder dies)."""
        folder = self._dir("locks")
        path = folder / f"{_checked_key(key)}.lock"
        with self._writing(folder):
            try:
                f = open(path, "a+b")  # noqa: SIM115 (closed below; only the open is the cache's)
            except FileNotFoundError:  # the folder was cleared just now: make it again, once
                self._dir("locks")
                f = open(path, "a+b")  # noqa: SIM115
        with f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def get_or_build(
        self,
        key: str,
        build: Callable[[Path], Mapping[str, Any]],
        *,
        parts: Mapping[str, Any] | None = None,
    ) -> tuple[Entry, bool]:
        """(entry, built): the valid entry of ``key``, built with ``build(folder)`` if needed.

        ``build`` writes the entry's files into the (empty) folder it is given and returns
        metadata to store with them; the entry is published atomically with checksums. Where
        the cache loses a folder under the build (cleared meanwhile), it builds once more; a
        second loss raises CacheVanished saying so."""
        entry = self.lookup(key)
        if entry is not None:
            return entry, False
        try:
            return self._build(key, build, parts)
        except SourceVanished:
            raise
        except CacheVanished as first:
            log.info("fp4gen cache: %s; building it again", first)
        try:
            return self._build(key, build, parts)
        except CacheVanished as again:
            raise CacheVanished(f"{again} ({CLEARED_MEANWHILE})", again.path) from again

    @contextlib.contextmanager
    def _staged(self, key: str, stage: Path) -> Iterator[None]:
        """Turn a failure of building into ``stage`` that the stage's loss explains (the folder
        is gone) into CacheVanished."""
        try:
            yield
        except CacheVanished:
            raise
        except Exception as err:
            if stage.is_dir():
                raise
            raise CacheVanished(
                f"cache entry {key}: its staging folder {stage} vanished while the kernel was "
                "built",
                stage,
            ) from err

    def _build(
        self, key: str, build: Callable[[Path], Mapping[str, Any]], parts: Mapping[str, Any] | None
    ) -> tuple[Entry, bool]:
        with self.lock(key):
            entry = self.lookup(key)  # another process may have built it while we waited
            if entry is not None:
                return entry, False
            tmp = self.work_dir()
            with self._writing(tmp):
                stage = Path(tempfile.mkdtemp(prefix=f"{key[:16]}-", dir=tmp))
            try:
                with self._staged(key, stage):
                    meta = dict(build(stage))
                    files = {}
                    for p in sorted(stage.iterdir()):
                        if p.is_file():
                            files[p.name] = {"size": p.stat().st_size, "sha256": _sha256_file(p)}
                    if not files:
                        raise CacheError(f"building cache entry {key} produced no files")
                    record = {
                        "key": key,
                        "created": time.time(),
                        "parts": dict(parts or {}),
                        "files": files,
                        **{k: v for k, v in meta.items() if k not in ("key", "files", "parts")},
                    }
                    with self._writing(stage):
                        _atomic_write(stage / ENTRY_FILE, json.dumps(record, indent=1).encode())
                self._dir("kernels")
                try:
                    os.rename(stage, self.entry_path(key))
                except OSError as err:
                    # lost a race (the folder exists now): keep the winner's entry if valid
                    entry = self.lookup(key)
                    if entry is not None:
                        return entry, False
                    if isinstance(err, FileNotFoundError):  # the stage or kernels/ was cleared
                        raise CacheVanished(
                            f"cache entry {key} could not be published: {path_problem(stage, err)}",
                            stage,
                        ) from err
                    raise
            finally:
                if stage.exists():
                    shutil.rmtree(stage, ignore_errors=True)
        entry = self.lookup(key)
        if entry is None:
            path = self.entry_path(key)
            raise CacheVanished(f"cache entry {path} vanished right after it was written", path)
        return entry, True

    # --- inspection and maintenance -----------------------------------------------------------
    def entries(self) -> list[Entry]:
        out = []
        if self.kernels_dir.is_dir():
            for path in sorted(self.kernels_dir.iterdir()):
                if _KEY.fullmatch(path.name) is None:
                    continue  # not an entry fp4gen made
                meta_file = path / ENTRY_FILE
                try:
                    meta = json.loads(meta_file.read_text())
                except (OSError, ValueError):
                    continue
                out.append(Entry(path.name, path, meta))
        return out

    def root_problem(self) -> str | None:
        """Why the root cannot be a cache folder (a file is in the way), or None."""
        blocker = file_in_the_way(self.root)
        if blocker is None:
            return None
        return f"{blocker} is a file, not a folder"

    def owned_paths(self) -> list[Path]:
        """What fp4gen wrote under the root: the files and folders ``clear`` removes.

        Only names fp4gen gives (see ``_OWNED_NAMES``) in real folders, never through a link,
        so user files kept beside or inside the cache are never counted or removed."""
        out: list[Path] = []
        dsl = self.dsl_cache_dir
        if dsl.is_dir() and not dsl.is_symlink():
            out.append(dsl)
        if not self.base.is_dir() or self.base.is_symlink():
            return out
        for folder, pattern in _OWNED_NAMES.items():
            path = self.base / folder
            if not path.is_dir() or path.is_symlink():
                continue
            out.extend(p for p in sorted(path.iterdir()) if pattern.fullmatch(p.name))
        return out

    def info(self) -> dict[str, Any]:
        """Location, state, entry counts and the bytes ``clear`` would free."""
        owned = self.owned_paths()
        sources = [p for p in owned if p.parent == self.sources_dir and p.suffix == ".py"]
        entries = self.entries()
        return {
            "location": str(self.root),
            "exists": self.root.is_dir(),
            "marked": self.marked,
            "kernels": len(entries),
            "sources": len(sources),
            "bytes": sum(_tree_size(p) for p in owned),
            "by_arch": _count(str(e.meta.get("parts", {}).get("arch", "?")) for e in entries),
        }

    def clear(self) -> int:
        """Remove fp4gen's entries (``owned_paths``) from a marked root; returns the bytes
        actually freed. Raises CacheError for a root that is a file or carries no marker."""
        problem = self.root_problem()
        if problem is not None:
            raise CacheError(
                f"cannot clear {self.root}: {problem} "
                "(point FP4GEN_CACHE_DIR or --cache-dir at the cache folder)"
            )
        if not self.root.is_dir():
            return 0  # nothing was ever cached here
        if not self.marked:
            raise CacheError(
                f"refusing to clear {self.root}: it has no {MARKER} marker, so it is not known "
                "to be an fp4gen cache and may hold other files; point FP4GEN_CACHE_DIR or "
                f"--cache-dir at a dedicated folder, or delete its {LAYOUT_VERSION}/ and "
                f"{DSL_DIR}/ folders by hand"
            )
        freed = sum(_remove_tree(p) for p in self.owned_paths())
        # the layout's own folders go too once empty; a folder still holding user files stays
        for folder in (*(self.base / f for f in _OWNED_NAMES), self.base):
            if not folder.is_symlink():
                with contextlib.suppress(OSError):
                    folder.rmdir()
        return freed


def _count(items: Iterator[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def _checked_key(key: str) -> str:
    """``key`` if it is a key ``KernelCache.key`` makes (it names a folder and a file)."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise CacheError(f"{key!r} is not a kernel cache key (40 lowercase hex digits)")
    return key


def _verify(path: Path) -> str | None:
    """None if the entry folder is whole, else what is wrong with it."""
    try:
        meta = json.loads((path / ENTRY_FILE).read_text())
        files = meta["files"]
    except FileNotFoundError:
        return f"no {ENTRY_FILE}"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {ENTRY_FILE}: {err}"
    if not isinstance(files, dict) or not files:
        return f"{ENTRY_FILE} lists no files"
    for name, want in files.items():
        f = path / name
        try:
            size = f.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want.get("size"):
            return f"{name} has {size} bytes, expected {want.get('size')}"
        if _sha256_file(f) != want.get("sha256"):
            return f"{name} does not match its checksum"
    return None


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and os.replace."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


__all__ = [
    "MARKER",
    "PLAIN_NAME_RULE",
    "CacheError",
    "CacheVanished",
    "Entry",
    "SourceVanished",
    "KernelCache",
    "cutlass_dsl_version",
    "default_root",
    "file_in_the_way",
    "inside",
    "is_plain_name",
    "path_problem",
    "sha256_text",
    "template_version",
    "toolchain",
]
