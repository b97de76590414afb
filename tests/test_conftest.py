"""tests/conftest.py: a failing report goes to $FP4GEN_TEST_FAILURES as it happens."""

from __future__ import annotations

import pytest
from conftest import pytest_runtest_logreport


def test_a_failure_is_written_at_once(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # as the controller
    log = tmp_path / "failures.txt"
    monkeypatch.setenv("FP4GEN_TEST_FAILURES", str(log))
    failed = pytest.TestReport("tests/x.py::t", ("x.py", 1, "t"), {}, "failed", "boom", "call")
    passed = pytest.TestReport("tests/x.py::u", ("x.py", 2, "u"), {}, "passed", None, "call")
    pytest_runtest_logreport(passed)
    pytest_runtest_logreport(failed)
    assert log.read_text() == "\n===== tests/x.py::t [call]\nboom\n"
    monkeypatch.delenv("FP4GEN_TEST_FAILURES")
    pytest_runtest_logreport(failed)  # unset: nothing written
    assert log.read_text().count("=====") == 1


def test_an_xdist_worker_leaves_it_to_the_controller(tmp_path, monkeypatch) -> None:
    log = tmp_path / "failures.txt"
    monkeypatch.setenv("FP4GEN_TEST_FAILURES", str(log))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    failed = pytest.TestReport("tests/x.py::t", ("x.py", 1, "t"), {}, "failed", "boom", "call")
    pytest_runtest_logreport(failed)
    assert not log.exists()
