"""Tests that stay independent of the order and the worker they run in (pytest-xdist).

Under ``pytest -n N`` each worker process runs an arbitrary subset of the tests in an arbitrary
order, so a test that reads process-wide state another test may have touched first passes or
fails by distribution (docs/testing.md, "GPU tests under xdist"). These CPU tests show the
hazard of fp4gen's log-once records with two test bodies run in either order in one process,
check that ``tests/log_records.py`` knows every such record in the package, and that the
environment a test hands a fresh process names the test's own caches.
"""

from __future__ import annotations

import ast
import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch

from fp4gen.runtime import cublaslt
from fp4gen.runtime.loader import LogOnce

sys.path.insert(0, str(Path(__file__).resolve().parent))
from log_records import LOG_ONCES, RECORDS, SETS, fresh_log_records  # noqa: E402
from test_cute_backend import script_env  # noqa: E402

sys.path.remove(str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
DECLINE = "cuBLASLt GEMM not used, torch GEMM + epilogue pass instead: operands on cpu"


def module_level_records(package: Path) -> set[tuple[str, str]]:
    """(module, name) of every module-level ``name = set()`` or ``name = LogOnce(...)`` in the
    package's source: the process-wide once-per-process records."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
                continue
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) in ("set", "LogOnce"):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.update((module, ast.unparse(t)) for t in targets)
    return found


def test_every_log_once_record_of_the_package_is_listed() -> None:
    """A record missing from tests/log_records.py would survive ``fresh_log_records``, and a
    test asserting its line would again depend on the tests run before it in the worker."""
    assert module_level_records(ROOT / "fp4gen") == set(RECORDS)
    for module_name, name in SETS:
        assert isinstance(getattr(importlib.import_module(module_name), name), set), name
    for module_name, name in LOG_ONCES:
        assert isinstance(getattr(importlib.import_module(module_name), name), LogOnce), name


def declined_body(caplog: pytest.LogCaptureFixture, out_dtype: torch.dtype) -> bool:
    """A test body: a cuBLASLt call on CPU tensors declines (None); whether it logged why."""
    caplog.clear()
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="fp4gen.runtime.cublaslt"):
        assert cublaslt.matmul(a, a, torch.ones(1), out_dtype=out_dtype) is None
    return DECLINE in [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("order", [("bf16", "fp32"), ("fp32", "bf16")], ids="-then-".join)
def test_a_log_once_record_makes_the_second_test_depend_on_the_first(
    order: tuple[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two test bodies (a bf16 and an fp32 output) that each assert the decline is logged, run
    one after the other in one process (an xdist worker that drew both): the second sees
    nothing, whichever runs first; each under ``fresh_log_records`` sees its own line."""
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    monkeypatch.setattr(cublaslt, "_logged", set())  # as in a worker that met neither before
    assert [declined_body(caplog, dtypes[name]) for name in order] == [True, False]
    seen = []
    for name in order:
        with pytest.MonkeyPatch.context() as each_test:
            fresh_log_records(each_test)
            seen.append(declined_body(caplog, dtypes[name]))
    assert seen == [True, True]


def test_fresh_records_leave_the_process_wide_ones_as_they_were(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The records are replaced for the test, not cleared: after it the process-wide objects
    are back, with their contents (what the process logged stays logged once)."""
    before = {
        (module_name, name): getattr(importlib.import_module(module_name), name)
        for module_name, name in RECORDS
    }
    contents = {key: set(r if isinstance(r, set) else r.seen) for key, r in before.items()}
    with pytest.MonkeyPatch.context() as test:
        fresh_log_records(test)
        for (module_name, name), record in before.items():
            assert getattr(importlib.import_module(module_name), name) is not record, name
        assert declined_body(caplog, torch.bfloat16)
    for (module_name, name), record in before.items():
        assert getattr(importlib.import_module(module_name), name) is record, name
        now = record if isinstance(record, set) else record.seen
        assert now == contents[(module_name, name)], name


def test_a_fresh_process_gets_the_tests_own_dsl_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """fp4gen points the CuTe DSL's file cache (CUTE_DSL_CACHE_DIR) at the first kernel cache a
    process compiles into, in ``os.environ`` (``jit.use_cache_for_dsl``): in an xdist worker,
    another test's cache. The environment a test gives a fresh process names its own."""
    monkeypatch.setenv("CUTE_DSL_CACHE_DIR", str(tmp_path / "another-tests-cache" / "cute-dsl"))
    env = script_env(tmp_path / "cache")
    assert env["FP4GEN_CACHE_DIR"] == str(tmp_path / "cache")
    assert env["CUTE_DSL_CACHE_DIR"] == str(tmp_path / "cache" / "cute-dsl")
