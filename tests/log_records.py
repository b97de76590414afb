"""fp4gen's process-wide log-once records, replaced by fresh ones for one test.

A fallback is logged once per process (a set of lines, or a ``LogOnce``). Under pytest-xdist a
worker runs an arbitrary subset of the tests in an arbitrary order, so a test that asserts a
fallback line is logged passes or fails depending on whether another test in that worker met
the same fallback first; one that asserts nothing is logged can miss a line another test logged.
``fresh_log_records(monkeypatch)`` gives the test empty records (restored after it), so what it
sees in ``caplog`` is what its own calls logged. ``RECORDS`` lists every such record in fp4gen
(``tests/test_test_isolation.py`` checks the list against the package's source).
"""

from __future__ import annotations

import importlib

import pytest

from fp4gen.runtime.loader import LogOnce

# (module, name): a module-level set of the lines (or reasons) already logged
SETS: tuple[tuple[str, str], ...] = (
    ("fp4gen.compiler.cache", "_warned"),
    ("fp4gen.gemm_dispatch", "_logged"),
    ("fp4gen.runtime.blackwell_grouped", "_logged"),
    ("fp4gen.runtime.cublaslt", "_logged"),
    ("fp4gen.runtime.experts", "_logged"),
    ("fp4gen.runtime.finite", "_logged"),
    ("fp4gen.runtime.fp8_grouped", "_logged"),
    ("fp4gen.runtime.grouped", "_logged"),
    ("fp4gen.runtime.grouped_quantize", "_logged"),
    ("fp4gen.runtime.grouped_tile", "_logged"),
    ("fp4gen.runtime.telemetry", "_skipped"),
    ("fp4gen.runtime.layer_graphs", "_logged"),
    ("fp4gen.runtime.layer_groups", "_logged"),
    ("fp4gen.runtime.linear", "_warned_out_of_step"),
)
# (module, name): a module-level LogOnce
LOG_ONCES: tuple[tuple[str, str], ...] = (
    ("fp4gen.runtime.attention", "_log_once"),
    ("fp4gen.runtime.cute_backend", "_log_once"),
    ("fp4gen.runtime.cute_backend", "_log_padded_once"),
    ("fp4gen.runtime.cute_backend", "_log_tile_once"),
    ("fp4gen.runtime.dequant", "_log_once"),
    ("fp4gen.runtime.fsdp", "_log_once"),
    ("fp4gen.runtime.grouped_scale", "_log_once"),
    ("fp4gen.runtime.mor_kernels", "_log_once"),
)
RECORDS = SETS + LOG_ONCES


def fresh_log_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every record of ``RECORDS`` replaced by an empty one until ``monkeypatch`` is undone (the
    test's end): module attributes, not the objects' contents, so the process-wide records are
    untouched and come back as they were."""
    for module_name, name in SETS:
        monkeypatch.setattr(importlib.import_module(module_name), name, set())
    for module_name, name in LOG_ONCES:
        module = importlib.import_module(module_name)
        once = getattr(module, name)
        monkeypatch.setattr(module, name, LogOnce(once.log, once.message))


__all__ = ["LOG_ONCES", "RECORDS", "SETS", "fresh_log_records"]
