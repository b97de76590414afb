"""``export_quantized`` of a model on a GPU (marker ``gpu``): the weights are quantized by the
CUDA kernels there, and a NaN or Inf in one is an ExportError naming the tensor, its shape and
the first bad index, as on the CPU (tests/test_export.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from fp4gen.demo.gpt import GPT, GPTConfig  # noqa: E402
from fp4gen.dsl import load_recipe  # noqa: E402
from fp4gen.export import ExportError, export_quantized  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
        reason="needs an sm_90 or sm_100 GPU",
    ),
]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_cuda_weight_names_its_tensor(tmp_path: Path, bad: float) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=3, width=64)).cuda()
    with torch.no_grad():
        model.blocks[1].mlp.fc1.weight[3, 7] = bad
    with pytest.raises(ExportError) as err:
        export_quantized(model, tmp_path / "out", load_recipe("nvfp4_small"))
    message = str(err.value)
    assert message.startswith("blocks.1.mlp.fc1.weight [256, 64]: "), message
    assert "1 non-finite value(s)" in message and "(3, 7)" in message, message
    assert not (tmp_path / "out").exists()
