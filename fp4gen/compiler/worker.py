"""A compile worker process: ``python -m fp4gen.compiler.worker`` (started by ``fp4gen compile``).

Reads one JSON task per line on stdin ({"source", "kernel", "arch", "dump_dir", "key", "parts"};
the key is the parent's, so both agree on it even if a template changes meanwhile) and answers one
JSON result per line on the original stdout ({"status": "ok" or "error: <one line>", "seconds",
"cached"; "vanished": true where the cache lost a file under the compile, which the parent may
try once more); whatever the compiler prints goes to stderr, with the traceback of a failure. The
parent sets CUTE_DSL_ARCH (one arch per worker, before the DSL is imported), FP4GEN_CACHE_DIR and
CUTE_DSL_CACHE_DIR in its environment. Separate processes because ``cute.compile`` is not
thread-safe; plain subprocesses (not multiprocessing) so that the caller's ``__main__`` is never
re-imported.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# A failure's reason in a result: one line, at most this long (the worker's log has the rest).
REASON_CHARS = 300


def failure_text(err: BaseException) -> str:
    """One line saying why a compile failed: fp4gen's own message, a file-system error's path
    and reason, else the exception's type and the first line of its message."""
    from fp4gen.errors import FP4GenError

    if isinstance(err, FP4GenError):
        text = str(err)
    elif isinstance(err, OSError) and err.strerror:
        paths = [str(p) for p in (err.filename, err.filename2) if p is not None]
        reason = err.strerror[:1].lower() + err.strerror[1:]
        text = f"{' -> '.join(paths)}: {reason}" if paths else reason
    else:
        text = f"{type(err).__name__}: {err}" if str(err).strip() else type(err).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(err).__name__]
    first = lines[0] + (" (...)" if len(lines) > 1 else "")
    return first if len(first) <= REASON_CHARS else first[: REASON_CHARS - 3] + "..."


def compile_task(task: dict[str, Any]) -> dict[str, Any]:
    from fp4gen.compiler import jit
    from fp4gen.compiler.cache import CacheVanished, KernelCache

    start = time.perf_counter()
    arch = task["arch"]
    if os.environ.get("CUTE_DSL_ARCH") != arch:
        return {"status": f"error: worker for {os.environ.get('CUTE_DSL_ARCH')} got {arch}"}
    try:
        built = jit.build_kernel(
            KernelCache(),
            Path(task["source"]),
            task["kernel"],
            arch,
            dump_dir=Path(task["dump_dir"]) if task.get("dump_dir") else None,
            key=(task["key"], task["parts"]) if task.get("key") else None,
        )
    except Exception as err:  # reported per kernel in one line; the others go on
        traceback.print_exc()  # the whole story, on stderr
        result: dict[str, Any] = {
            "status": f"error: {failure_text(err)}",
            "seconds": 0.0,
            "cached": False,
        }
        if isinstance(err, CacheVanished):
            result["vanished"] = True
        return result
    return {
        "status": "ok",
        "seconds": round(built.compile_seconds, 3),
        "cached": not built.built,
        "wall": round(time.perf_counter() - start, 3),
    }


def main() -> int:
    # keep the real stdout for answers; send everything else printed to stderr
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    for line in sys.stdin:
        if not line.strip():
            continue
        result = compile_task(json.loads(line))
        answers.write(json.dumps(result) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
