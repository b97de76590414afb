"""The pieces the code generators (``fp4gen.codegen.render``) and the kernel backends
(``fp4gen.runtime.checks``) share: their spellings and messages."""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError, dataclass
from types import SimpleNamespace

import pytest
import torch

from fp4gen.codegen.render import (
    SpecEntries,
    TemplateContext,
    inline,
    input_context,
    lit,
    pytuple,
    render_template,
    tidy,
)
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.runtime.checks import (
    check_accumulate,
    check_bias,
    check_pair,
    launch_rows,
    not_cuda,
    one_cuda_device,
    served_by_reference,
)


def test_literals() -> None:
    assert pytuple(["a", "b"]) == '("a", "b")'
    assert pytuple(["a"]) == '("a",)'
    assert pytuple([]) == "()"
    assert pytuple([16, 16]) == "(16, 16)"
    assert lit(math.inf) == "math.inf" and lit(-math.inf) == "-math.inf"
    assert lit(3.4028234663852886e38) == "3.4028234663852886e38"
    assert lit(0.5) == "0.5"


def test_tidy_spaces_top_level_definitions() -> None:
    source = "X = 1\ndef f():\n    return 1\n# note\nY = 2\n\n\n\n\nZ = 3   \n\n"
    assert tidy(source) == "X = 1\n\n\ndef f():\n    return 1\n\n\n# note\nY = 2\n\n\nZ = 3\n"


def test_spec_entries_and_templates_render() -> None:
    spec = SimpleNamespace(name="k", digest="d")
    entries = SpecEntries.of(spec).as_template_vars()
    assert entries["name"] == "k" and entries["digest"] == "d" and entries["spec"] is spec
    assert entries["spec_repr"] == repr(spec)
    # a macro file renders nothing of its own at the top level
    assert render_template("common.j2", {}) == "\n"


@dataclass(frozen=True)
class _Inner(TemplateContext):
    a: int


@dataclass(frozen=True)
class _Outer(TemplateContext):
    inner: _Inner = inline()
    b: str


@dataclass(frozen=True)
class _Holder(TemplateContext):
    inner: _Inner


@dataclass(frozen=True)
class _Clash(TemplateContext):
    inner: _Inner = inline()
    a: int


def test_typed_contexts() -> None:
    """A typed context is frozen, spreads its inline() fields into the template's variables
    (shallowly: nested contexts stay objects) and refuses a variable defined twice."""
    outer = _Outer(_Inner(1), "x")
    assert outer.as_template_vars() == {"a": 1, "b": "x"}
    assert _Holder(outer.inner).as_template_vars()["inner"] is outer.inner
    with pytest.raises(FrozenInstanceError):
        outer.b = "y"  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"template variables \['a'\] twice"):
        _Clash(_Inner(1), 2).as_template_vars()
    with pytest.raises(TypeError):
        _Outer(_Inner(1))  # type: ignore[call-arg]  # a missing field fails where it is built
    spec = SimpleNamespace(name="k", digest="d")
    assert SpecEntries.of(spec).as_template_vars() == {
        "spec": spec,
        "spec_repr": repr(spec),
        "name": "k",
        "digest": "d",
    }
    assert render_template("common.j2", outer) == "\n"
    bf16 = input_context("bf16")
    assert (bf16.name, bf16.cutlass, bf16.torch) == ("bf16", "BFloat16", "bfloat16")


def _q(rows: int, cols: int, rht: object = None) -> SimpleNamespace:
    return SimpleNamespace(rows=rows, cols=cols, rht=rht, device=torch.device("cpu"))


def test_gemm_checks_keep_the_backends_messages() -> None:
    check_pair(_q(4, 32), _q(8, 32))
    with pytest.raises(TensorError, match=r"K mismatch: a is \[4, 32\] and b is \[8, 64\]"):
        check_pair(_q(4, 32), _q(8, 64))
    with pytest.raises(TensorError, match="the operands carry different Hadamard transforms"):
        check_pair(_q(4, 32, rht=16), _q(8, 32))
    with pytest.raises(
        TensorError, match="the fused GEMM needs both operands on one CUDA device: cpu, cpu"
    ):
        one_cuda_device(_q(4, 32), _q(8, 32), "fused GEMM")
    check_bias(None, 8)
    check_bias(torch.zeros(8), 8)
    with pytest.raises(TensorError, match=r"bias must have shape \[8\], got \(4,\)"):
        check_bias(torch.zeros(4), 8)
    check_accumulate(torch.zeros(4, 8), 4, 8)
    with pytest.raises(TensorError, match=r"accumulate has shape \(8, 4\), the product \(4, 8\)"):
        check_accumulate(torch.zeros(8, 4), 4, 8)


def test_quantize_input_handling() -> None:
    assert not_cuda(torch.zeros(2)) == "it runs on CUDA tensors, got a tensor on cpu"
    assert not_cuda([1.0]) == "it runs on CUDA tensors, got a tensor on list"
    assert launch_rows(torch.zeros(6)).shape == (1, 6)
    x = torch.zeros(2, 3, 4)
    assert launch_rows(x).shape == (6, 4)
    strided = torch.zeros(4, 8)[:, ::2]
    rows = launch_rows(strided)
    assert rows.is_contiguous() and rows.shape == (4, 4)
    logged: list[str] = []
    served_by_reference(
        "why", required=False, kernels="generated MoR kernels", log_once=logged.append
    )
    assert logged == ["why"]
    with pytest.raises(
        FP4GenError,
        match=r"the 'cute' backend \(generated MoR kernels\) is not available: why",
    ):
        served_by_reference("why", required=True, kernels="generated MoR kernels", log_once=print)
