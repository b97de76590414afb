"""Session setup shared by every test module.

Under pytest-xdist each worker takes its share of the cores for torch's CPU ops (the
reference, which the GPU tests compare with, runs there): N workers each starting one thread
per core oversubscribe the CPU N times over."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and workers.isdigit() and int(workers) > 0:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
