"""Session setup shared by every test module.

- Under pytest-xdist each worker takes its share of the cores for torch's CPU ops (the
  reference, which the GPU tests compare with, runs there): N workers each starting one thread
  per core oversubscribe the CPU N times over.
- ``FP4GEN_TEST_FAILURES=FILE`` appends each failing test's report to FILE as it fails, so a run
  that a time limit kills (whose summary pytest never prints) keeps its tracebacks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and workers.isdigit() and int(workers) > 0:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture
def fp8_prepared_on() -> Iterator[None]:
    """Prepared FP8 calls on for a test (``gemm_dispatch.set_fp8_prepared``, on by default;
    an earlier test may have turned them off), put back after."""
    from fp4gen import gemm_dispatch

    previous = gemm_dispatch.set_fp8_prepared(True)
    yield
    gemm_dispatch.set_fp8_prepared(previous)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("FP4GEN_TEST_FAILURES")
    # under xdist the controller writes it (a worker's report reaches it at once), not both
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as out:  # one append per report: workers' lines do not interleave
            out.write(f"\n===== {report.nodeid} [{report.when}]\n{report.longreprtext}\n")
