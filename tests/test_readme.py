"""The README's Python example runs as written, and its commands name real things."""

from __future__ import annotations

import re
from pathlib import Path

import fp4gen

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_examples_run(monkeypatch) -> None:
    monkeypatch.chdir(README.parent)
    namespace: dict[str, object] = {}
    blocks = python_blocks()
    assert len(blocks) == 2
    for block in blocks:  # the examples build on each other, like a session
        exec(compile(block, str(README), "exec"), namespace)
    q = namespace["q"]
    assert isinstance(q, fp4gen.QuantizedTensor)
    assert tuple(q.codes.shape) == (272, 304)
    assert tuple(q.data.shape) == (272, 152)
    assert tuple(q.scales.shape) == (272, 19)
    assert tuple(namespace["y"].shape) == (272, 128)
    assert "runs in" in fp4gen.show_plan(namespace["model"])
    assert isinstance(namespace["records"], list)


def test_readme_commands() -> None:
    text = README.read_text()
    assert 'pip install -e ".[dev]" && fp4gen show recipes/nvfp4.fp4r' in text
    assert 'pip install -e ".[dev]" && pytest' in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[dev]" && pytest' in ci


def test_public_api_names() -> None:
    for name in fp4gen.__all__:
        assert getattr(fp4gen, name) is not None
