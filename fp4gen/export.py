"""Checkpoint export and import in the layouts inference engines already load.

``export_quantized`` writes a model's weights as a Hugging Face folder of safetensors files in
which the linear layers a recipe quantizes are stored quantized:

- NVFP4, NVIDIA Model Optimizer's unified checkpoint: ``<layer>.weight`` uint8 [N, K/2] (two
  e2m1 codes per byte, element 0 in the low nibble), ``<layer>.weight_scale`` float8_e4m3fn
  [N, K/16] (the block scale codes, row-major, not swizzled), ``<layer>.weight_scale_2`` fp32
  scalar (the global decode scale), and ``<layer>.input_scale`` fp32 when calibrated. The
  configs say quant_algo ``NVFP4`` (W4A4) only with calibrated input scales; without them
  ``W4A16_NVFP4`` (weights only), so no loader quantizes activations with a made-up scale.
- MXFP8 and MXFP4, the OCP MX layout: ``<layer>.weight`` float8_e4m3fn [N, K] (MXFP8) or uint8
  [N, K/2] (MXFP4), ``<layer>.weight_scale`` uint8 [N, K/32] ue8m0 exponent codes.

Every other tensor is written as it is (cast to bf16 by default), ``hf_quant_config.json`` says
which format and which layers stay in high precision, and config.json (for a Hugging Face
model) gets a ``quantization_config`` entry in Model Optimizer's form: quant_method
``modelopt`` where an engine's ModelOpt loader reads the checkpoint (NVFP4, W4A16_NVFP4,
MXFP8), else ``fp4gen`` (MXFP4, and mixed checkpoints), which engines refuse rather than
misread.

Which layers are quantized is the recipe's plan (``fp4gen.runtime.convert.plan_layers``, what
``fp4gen.convert`` and ``show_plan`` use), and each layer's format is its fprop weight operand:
the weight exactly as the forward GEMM quantized it in training. Inference layouts have one
scale per row and K block, so a 2D (16x16 or 32x32) weight quantization is written with its
tile scale repeated over the tile's rows: each element keeps its code and its scale, so it
decodes to the same value bit for bit (``import_quantized`` checks nothing else is needed).

The experts of a Mixtral or Qwen3-MoE model (one module of 3-D parameters in transformers 5)
are written per expert in the layout of the family's hub checkpoints, each expert's gate, up and
down projection a layer of the checkpoint's format (``EXPERTS_HUB``, ``experts_export``; gate and
up share the fused slice's global scale). gpt-oss experts quantized in MXFP4 are written as
gpt-oss's own hub checkpoints hold them (``<experts>.gate_up_proj_blocks`` uint8 [E, 2I, H/32,
16] and ``_scales`` uint8 [E, 2I, H/32] ue8m0, ``down_proj_blocks`` / ``_scales`` likewise, the
biases as they are) with config.json's ``quantization_config`` {"quant_method": "mxfp4"}, which
transformers' Mxfp4 quantizer and vLLM's gpt-oss loader read (``GPT_OSS_MXFP4``); both load
every other linear layer in high precision, so such a checkpoint writes them so. Other experts
without a per-expert layout (gpt-oss in another format) are written as 3-D tensors in high
precision and listed in exclude_modules.

``import_quantized`` reads such a folder back into a state_dict of dequantized weights (the
experts' 3-D parameters put back together).
"""

from __future__ import annotations

import fnmatch
import json
import math
import pickle
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.outputs import OutputError, OutputFiles
from fp4gen.table import render_table

if TYPE_CHECKING:
    from fp4gen.dsl.model import OperandSpec, Recipe
    from fp4gen.runtime.convert import LayerDecision

QUANT_CONFIG = "hf_quant_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# quant_algo -> elements per block along K (the checkpoint's group_size)
GROUP_SIZE: dict[str, int] = {"NVFP4": 16, "MXFP8": 32, "MXFP4": 32}
# the checkpoint's quant_algo of an NVFP4 layer without a calibrated input_scale: Model
# Optimizer's weight-only NVFP4, activations kept in high precision (an "NVFP4" layer is W4A4,
# and a loader would quantize its activations with whatever input_scale it finds or defaults)
W4A16_NVFP4 = "W4A16_NVFP4"
# checkpoint quant_algo -> the weight layout written (what import_quantized decodes)
LAYOUT: dict[str, str] = {**{algo: algo for algo in GROUP_SIZE}, W4A16_NVFP4: "NVFP4"}
# quant_algo values an engine's ModelOpt loader reads in fp4gen's layout (vLLM's modelopt.py:
# NVFP4 and W4A16_NVFP4 as modelopt_fp4, MXFP8 as modelopt_mxfp8); MXFP4 and MIXED_PRECISION
# with MX layers are not among them, so config.json does not claim "modelopt" for those
ENGINE_ALGOS: tuple[str, ...] = ("NVFP4", W4A16_NVFP4, "MXFP8")
NO_ENGINE = "fp4gen"  # config.json's quant_method where no engine loader reads the checkpoint
EXPORTABLE = (
    "NVFP4 (e2m1 elements, 1x16 or 16x16 blocks, e4m3 scales), MXFP8 (e4m3 elements, 1x32 or "
    "32x32 blocks, ue8m0 scales, no global scale) and MXFP4 (e2m1 elements, 1x32 or 32x32 "
    "blocks, ue8m0 scales, no global scale), without an RHT on the fprop weight"
)

# The 16 e2m1 values by code, sign bit 3: the importer decodes with its own table rather than
# fp4gen's encoder tables, so a round trip checks the layout against the OCP definition.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES: tuple[float, ...] = _E2M1 + tuple(-v for v in _E2M1)

# Module names of a plain state_dict that are embedding tables, not linear layers: both are
# 2-D ".weight" tensors, and only the name tells them apart (matched on the last component).
EMBEDDING_NAMES: tuple[str, ...] = ("*emb*", "wte", "wpe", "tok", "pos")

_WEIGHT_FILES = ("*.safetensors", INDEX_FILE, QUANT_CONFIG)  # what a new export replaces
HF_CONFIG_FILES = ("config.json", "generation_config.json")  # written for a transformers model


class ExportError(FP4GenError):
    """A model, recipe, folder or checkpoint that cannot be exported or imported."""


# ---------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------


def export_algo(spec: OperandSpec, layer: str) -> str | None:
    """The checkpoint format (``NVFP4``, ``MXFP8``, ``MXFP4``) of a layer's fprop weight
    operand, None when the recipe keeps it in high precision; ExportError for anything else."""
    from fp4gen.dsl.model import MoRRef
    from fp4gen.formats import E2M1, E4M3, UE8M0, BlockFormat, HighPrecision

    fmt = spec.format
    if isinstance(fmt, HighPrecision):
        return None
    if isinstance(fmt, MoRRef):
        raise ExportError(
            f"{layer}: the fprop weight uses the MoR rule {fmt.name!r}, which picks a format per "
            f"block at run time and has no checkpoint layout; exportable: {EXPORTABLE}"
        )
    assert isinstance(fmt, BlockFormat)
    rows, cols = fmt.block
    square = rows in (1, cols)
    algo = None
    # the scale rounding (nearest, up, down, ocp) only decides which code is chosen: any code
    # decodes the same way, so it does not matter here
    if square and fmt.element == E2M1 and cols == 16 and fmt.scale.element == E4M3:
        algo = "NVFP4"  # without a global scale its weight_scale_2 is 1.0, which decodes alike
    elif square and cols == 32 and fmt.scale.element == UE8M0 and not fmt.global_scale:
        algo = {E4M3: "MXFP8", E2M1: "MXFP4"}.get(fmt.element)
    if algo is None:
        scale = fmt.scale.name
        glob = "amax" if fmt.global_scale else "none"
        raise ExportError(
            f"{layer}: the fprop weight format {fmt.name} ({fmt.element.name} elements, "
            f"{rows}x{cols} blocks, {scale} scales, global {glob}) has no inference checkpoint "
            f"layout; exportable: {EXPORTABLE}"
        )
    if spec.rht is not None:
        raise ExportError(
            f"{layer}: the fprop weight of {fmt.name} has a Random Hadamard Transform, which an "
            f"inference engine does not undo; exportable: {EXPORTABLE}"
        )
    return algo


def _group_config(algo: str) -> dict[str, Any]:
    """A compressed-tensors config group for a checkpoint quant_algo, in the form Model
    Optimizer writes into config.json, saying only what the checkpoint holds: NVFP4 (W4A4)
    activations are static (the calibrated ``input_scale`` is written), W4A16_NVFP4 has no
    activation entry (weight-only), MX activations are dynamic (their block scales are computed
    at run time; nothing is written for them)."""
    layout = LAYOUT[algo]
    bits = 8 if layout == "MXFP8" else 4
    weights = {
        "dynamic": False,
        "num_bits": bits,
        "type": "float",
        "group_size": GROUP_SIZE[layout],
    }
    if algo == W4A16_NVFP4:
        return {"weights": weights}
    activations = {**weights, "dynamic": algo != "NVFP4"}
    return {"input_activations": activations, "weights": weights}


def engine_note(quant_algo: str) -> str:
    """Which loader reads a checkpoint of this quant_algo, and how, in one sentence."""
    if quant_algo == "NVFP4":
        return (
            "W4A4 NVFP4 with calibrated static input scales: vLLM's ModelOpt loader "
            "(modelopt_fp4) reads it"
        )
    if quant_algo == W4A16_NVFP4:
        return (
            "NVFP4 weights only (W4A16_NVFP4: activations stay in high precision, no "
            "input_scale without calibration): vLLM's ModelOpt loader reads it with its NVFP4 "
            "weight-only kernel; for W4A4 export with calibration samples (--calibrate)"
        )
    if quant_algo == "MXFP8":
        return (
            "MXFP8, activations quantized at run time: vLLM's ModelOpt loader (modelopt_mxfp8) "
            "reads it"
        )
    return (
        f"{quant_algo}: no inference engine's loader reads this layout (vLLM's ModelOpt loader "
        "has no MXFP4, and its MIXED_PRECISION only FP8 and NVFP4 layers), so config.json "
        f'says quant_method "{NO_ENGINE}"; read it back with fp4gen.import_quantized'
    )


GPT_OSS_NOTE = (
    "gpt-oss's MXFP4 checkpoint: the experts as gpt-oss's hub checkpoints hold them "
    '(*_blocks, *_scales), config.json quant_method "mxfp4": transformers\' Mxfp4 quantizer '
    "(dequantized to bf16 where it has no MXFP4 kernel) and vLLM's gpt-oss loader read it; the "
    "other linear layers in high precision, as those loaders read them"
)


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportReport:
    """What ``export_quantized`` wrote: the format, which layer went how, and the files."""

    out_dir: Path
    quant_algo: str  # NVFP4, MXFP8, MXFP4, or MIXED_PRECISION when layers differ
    layers: tuple[tuple[str, str, str], ...]  # (layer, "NVFP4" / "kept", why)
    files: tuple[str, ...]
    quantized: dict[str, str]  # layer -> quant_algo
    excluded: tuple[str, ...]  # the exclude_modules list
    replaced: tuple[str, ...] = ()  # files of out_dir this export replaced or removed (overwrite)
    config_algo: str = ""  # the configs' quant_algo: W4A16_NVFP4 for NVFP4 without input_scale
    engine: str = ""  # which loader reads the checkpoint, and how (engine_note)

    def table(self) -> str:
        return render_table(["module", "written as", "why"], [list(row) for row in self.layers])


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module of a known MoE family goes into a checkpoint: per expert, 2-D
    ``<prefix>.<e>.<gate|up|down>`` layers (the layout of the family's Hugging Face hub
    checkpoints, which transformers 5 fuses on load and inference engines read), the module's
    MoE block renamed where the hub names it otherwise (Mixtral's ``block_sparse_moe``)."""

    module: str  # the experts module's name in the model (``model.layers.0.mlp.experts``)
    count: int
    names: tuple[str, str, str]  # the per-expert gate, up and down projections
    prefix: str  # the per-expert layers' prefix in the checkpoint
    block: tuple[str, str] | None  # (the MoE block's name in the model, in the checkpoint)
    inner: int  # I: the gate's and the up projection's out features

    def layer(self, expert: int, proj: int) -> str:
        return f"{self.prefix}.{expert}.{self.names[proj]}"

    def layers(self) -> list[str]:
        return [self.layer(e, p) for e in range(self.count) for p in range(3)]

    def key(self, key: str) -> str:
        """A state_dict key as the checkpoint names it (inside the renamed block or not)."""
        if self.block is not None and key.startswith(self.block[0] + "."):
            return self.block[1] + key[len(self.block[0]) :]
        return key

    def described(self) -> dict[str, Any]:
        """What ``import_quantized`` needs to put the 3-D tensors back together."""
        return {
            "module": self.module,
            "experts": self.count,
            "names": list(self.names),
            "prefix": self.prefix,
            "block": None if self.block is None else list(self.block),
        }


# The experts classes whose hub checkpoints hold per-expert 2-D projections (transformers'
# conversion_mapping.py merges them into gate_up_proj = cat(gate, up) and down_proj on load):
# class -> (gate, up, down names, the MoE block's hub name where it differs from the model's).
# gpt-oss is not among them: its hub checkpoints hold 3-D experts tensors (interleaved gate and
# up, biases; MXFP4 in a blocks-and-scales layout of its own).
EXPERTS_HUB: dict[str, tuple[tuple[str, str, str], str | None]] = {
    "MixtralExperts": (("w1", "w3", "w2"), "block_sparse_moe"),
    "Qwen2MoeExperts": (("gate_proj", "up_proj", "down_proj"), None),
    "Qwen3MoeExperts": (("gate_proj", "up_proj", "down_proj"), None),
}


# gpt-oss's MXFP4 checkpoint (the openai/gpt-oss hub folders): each experts module's two 3-D
# weights as ``<proj>_blocks`` (two e2m1 codes per byte, element 0 in the low nibble, 16 bytes
# per 32-value block) and ``<proj>_scales`` (ue8m0 codes), [out, in] per expert, and config.json
# quant_method "mxfp4". transformers (integrations/mxfp4.py) and vLLM (quantization/mxfp4.py:
# every LinearBase unquantized) load the other linear layers in high precision.
GPT_OSS_MXFP4 = "mxfp4"  # config.json's quant_method
GPT_OSS_DENSE_REASON = (
    "gpt-oss's MXFP4 checkpoints quantize the experts only: transformers' Mxfp4 quantizer and "
    "vLLM's mxfp4 method load every other linear layer in high precision"
)


def experts_export(name: str, module: nn.Module) -> ExpertsLayout | str:
    """The checkpoint layout of the experts module ``name`` (a ``GroupedExperts`` or the
    transformers module it replaces), or why it has none."""
    from fp4gen.runtime.experts import experts_layout

    source = getattr(module, "source", module)
    kind = type(source).__name__
    layout = getattr(module, "layout", None) or experts_layout(module)
    if isinstance(layout, str) or layout is None:
        return f"{kind}: not a grouped-experts module ({layout})"
    hub = EXPERTS_HUB.get(kind)
    if kind == "GptOssExperts":
        return (
            "gpt-oss checkpoints hold 3-D experts tensors (interleaved gate and up, biases; "
            "MXFP4 in blocks and scales of their own)"
        )
    if hub is None:
        return f"{kind}: no per-expert checkpoint layout is known for its family"
    if layout.transposed or layout.bias or not layout.gated:
        return f"{kind}: its layout is not the [E, 2I, H] / [E, H, I] one of its family"
    names, block_name = hub
    parent, _, leaf = name.rpartition(".")
    block = None
    if block_name is not None and parent:
        grand, _, old = parent.rpartition(".")
        if old != block_name:
            block = (parent, f"{grand}.{block_name}" if grand else block_name)
    prefix = f"{block[1] if block else parent}.{leaf}" if parent else leaf
    return ExpertsLayout(name, layout.num_experts, names, prefix, block, layout.inner)


@dataclass
class _Layer:
    name: str
    weight: torch.Tensor  # [N, K]: [out, in] (a Conv1D's [in, out] weight transposed)
    conv1d: bool
    reason: str
    algo: str | None = None  # None: written in high precision
    spec: OperandSpec | None = None
    experts: ExpertsLayout | None = None  # an experts module written per expert
    gpt_oss: bool = False  # gpt-oss experts in gpt-oss's MXFP4 layout (3-D blocks and scales)
    # the experts' inputs take one global amax over every expert (global per tensor)
    inputs_per_tensor: bool = False

    def names(self) -> list[str]:
        """The checkpoint's layer names this layer is written as."""
        return [self.name] if self.experts is None else self.experts.layers()


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB" or "2GiB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.I)
        if match is None:
            raise ExportError(
                f"max_shard_size (--max-shard-size) {size!r}: give bytes or a size such as 5GB, "
                "500MB or 2GiB"
            )
        unit = (match.group(2) or "B").upper()
        power = "BKMGT".index(unit[0])
        base = 1024 if "I" in unit else 1000
        value = int(float(match.group(1)) * base**power)
    if value < 1:
        raise ExportError(f"max_shard_size (--max-shard-size) {size!r}: at least one byte")
    return value


def check_out_dir(
    out: Path, overwrite: bool, source: Path | None, names: Iterable[str] = HF_CONFIG_FILES
) -> None:
    """ExportError, one line, for an output path that is a file, the source model's folder, a
    folder already holding a checkpoint or any of ``names`` (the other files the export will
    write; unless ``overwrite``), or holding a symbolic link where a file is to be written
    (even with ``overwrite``: nothing is written through a link)."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: is a file, not a folder: give an output folder")
    if source is not None and out.exists() and out.resolve() == source.resolve():
        raise ExportError(f"{out}: is the model's own folder: give another output folder")
    if not out.is_dir():
        return
    old = sorted(p.name for pat in _WEIGHT_FILES for p in out.glob(pat))
    try:
        # a link at any name the export may write, whatever overwrite says
        OutputFiles(out).refuse_existing([SINGLE_FILE, INDEX_FILE, QUANT_CONFIG, *old, *names])
    except OutputError as err:
        raise ExportError(str(err)) from None
    if not overwrite:
        if old:
            shown = ", ".join(old[:3]) + (", ..." if len(old) > 3 else "")
            raise ExportError(
                f"{out}: already holds a checkpoint ({shown}); pass overwrite=True "
                "(--overwrite) to replace it"
            )
        try:
            hint = "overwrite=True (--overwrite)"
            OutputFiles(out, overwrite=False).refuse_existing(names, hint=hint)
        except OutputError as err:
            raise ExportError(str(err)) from None


def _is_embedding(name: str) -> bool:
    last = name.rpartition(".")[2].lower()
    return any(fnmatch.fnmatchcase(last, pat) for pat in EMBEDDING_NAMES)


def skeleton(state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """A module tree on the meta device with an nn.Linear for every linear layer of a plain
    state_dict, so that a recipe's layer rules (blocks, layer indices, globs) plan it as they
    plan the model: a linear layer is a module whose tensors are a 2-D floating ``weight`` and
    an optional ``bias`` of its row count, with no submodules and a name that is not an
    embedding's (``EMBEDDING_NAMES``). Numbered children make an nn.Sequential, the repeated
    blocks ``first/last N blocks`` count. Weights are read as nn.Linear's [out, in]."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        module, _, leaf = key.rpartition(".")
        tensors.setdefault(module, {})[leaf] = value
    prefixes = {name[:i] for name in tensors for i, ch in enumerate(name) if ch == "."}

    tree: dict[str, Any] = {}
    for name, leaves in tensors.items():
        w, b = leaves.get("weight"), leaves.get("bias")
        if (
            not name
            or set(leaves) - {"weight", "bias"}
            or not isinstance(w, torch.Tensor)
            or w.dim() != 2
            or not w.is_floating_point()
            or (b is not None and tuple(b.shape) != (w.shape[0],))
            or name in prefixes  # it has submodules
            or "" in name.split(".")
            or _is_embedding(name)
        ):
            continue
        node = tree
        *path, last = name.split(".")
        for part in path:  # never a linear layer: those have no submodules
            node = node.setdefault(part, {})
        node[last] = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")

    def build(node: dict[str, Any]) -> nn.Module:
        numbered = all(part.isdigit() for part in node)
        module: nn.Module = nn.Sequential() if numbered else nn.Module()
        for part, child in node.items():
            module.add_module(part, child if isinstance(child, nn.Module) else build(child))
        return module

    return build(tree)


def _decisions(
    model: nn.Module | Mapping[str, torch.Tensor], recipe: Recipe | str | None
) -> tuple[list[LayerDecision], dict[str, torch.Tensor]]:
    """The recipe's plan for every linear layer, and the tensors to write."""
    from fp4gen.runtime.convert import plan_layers

    converted = getattr(model, "_fp4gen_plan", None)
    if converted is not None:
        if recipe is not None:
            raise ExportError(
                "this model was converted with fp4gen.convert, whose plan decides which layers "
                "are quantized: call export_quantized without a recipe"
            )
        return list(converted), _module_state(model)  # type: ignore[arg-type]
    if recipe is None:
        raise ExportError(
            "give a recipe (a Recipe, a path or a shipped name): it decides which layers are "
            "quantized and in which format"
        )
    if isinstance(recipe, str):
        from fp4gen.dsl import load_recipe

        recipe = load_recipe(recipe)
    if isinstance(model, nn.Module):
        return plan_layers(model, recipe), _module_state(model)
    if isinstance(model, Mapping):
        state = dict(model)
        bad = [k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)]
        if bad:
            raise ExportError(
                f"a state_dict maps names to tensors; {bad[0]!r} holds a "
                f"{type(state[bad[0]]).__name__}"
            )
        return plan_layers(skeleton(state), recipe), state
    raise ExportError(
        f"export_quantized takes an nn.Module or a state_dict, got {type(model).__name__}"
    )


def _module_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with each linear layer's weight under its module's name: an
    attention's input projection (``runtime.attention``) as ``in_proj.weight``."""
    from fp4gen.runtime.attention import module_keys

    return module_keys(model, dict(model.state_dict()))


def _layers(
    decisions: list[LayerDecision],
    state: dict[str, torch.Tensor],
    modules: Mapping[str, nn.Module] | None = None,
) -> list[_Layer]:
    layers = []
    for d in decisions:
        weight = state.get(f"{d.name}.weight")
        if d.experts and weight is None:
            layers.append(_experts_layer(d, state, None if modules is None else modules[d.name]))
            continue
        if weight is None or weight.dim() != 2:
            continue  # nothing this layout can hold (no weight in its state_dict)
        if d.conv1d:
            weight = weight.t()
        layer = _Layer(d.name, weight, d.conv1d, f"{d.precision} ({d.reason})")
        if not d.kept:
            assert d.table is not None
            layer.spec = d.table.fprop_weight
            layer.algo = export_algo(layer.spec, d.name)
            if layer.algo is None:
                layer.reason = f"fprop weight in {layer.spec.format.name} ({d.reason})"
            elif weight.shape[1] % GROUP_SIZE[layer.algo]:
                layer.reason = (
                    f"K={weight.shape[1]} is not a multiple of the {layer.algo} group size "
                    f"{GROUP_SIZE[layer.algo]}"
                )
                layer.algo = None
        layers.append(layer)
    return layers


def _experts_layer(
    d: LayerDecision, state: dict[str, torch.Tensor], module: nn.Module | None
) -> _Layer:
    """An experts module's layer: written per expert in its family's checkpoint layout
    (``experts_export``), quantized as its fprop weight operand where the recipe quantizes it;
    else (no known layout) its 3-D tensors in high precision under their own keys, listed in
    exclude_modules so that no engine reads them as quantized."""
    found = "no model" if module is None else experts_export(d.name, module)
    if isinstance(found, str) and module is not None:
        layer = _gpt_oss_layer(d, state, module)
        if layer is not None:
            return layer
    if isinstance(found, str):
        reason = (
            f"{d.experts} experts: written in high precision as 3-D tensors ({found}; "
            f"trained as {d.precision})"
        )
        return _Layer(d.name, torch.empty(0), False, reason)
    layer = _Layer(d.name, torch.empty(0), False, f"{d.precision} ({d.reason})", experts=found)
    if d.kept:
        layer.reason = f"{d.precision} ({d.reason}); per expert as {found.prefix}.<e>.*"
        return layer
    assert d.table is not None
    layer.spec = d.table.fprop_weight
    layer.inputs_per_tensor = d.table.fprop_activation.global_scope == "tensor"
    layer.algo = export_algo(layer.spec, d.name)
    where = f"per expert as {found.prefix}.<e>.{{{','.join(found.names)}}}"
    if layer.algo is None:
        layer.reason = f"fprop weight in {layer.spec.format.name} ({d.reason}); {where}"
        return layer
    hidden = state[f"{d.name}.down_proj"].shape[1]
    group = GROUP_SIZE[layer.algo]
    bad = [k for k in (hidden, found.inner) if k % group]
    if bad:
        layer.reason = f"K={bad[0]} is not a multiple of the {layer.algo} group size {group}"
        layer.algo = None
        return layer
    layer.reason = f"{d.precision} ({d.reason}); {where}, gate and up share a global scale"
    return layer


def _gpt_oss_layer(
    d: LayerDecision, state: dict[str, torch.Tensor], module: nn.Module
) -> _Layer | None:
    """gpt-oss experts the recipe quantizes in MXFP4 (1x32 or 32x32 blocks, ue8m0 scales)
    with H and I multiples of 32: a layer written in gpt-oss's own MXFP4 layout; None for
    anything else (other formats keep the 3-D high-precision export and its reason)."""
    if type(getattr(module, "source", module)).__name__ != "GptOssExperts" or d.kept:
        return None
    assert d.table is not None
    spec = d.table.fprop_weight
    try:
        if export_algo(spec, d.name) != "MXFP4":
            return None
    except ExportError:  # no checkpoint layout at all: the 3-D high-precision export, as before
        return None
    down = state[f"{d.name}.down_proj"]  # [E, I, H] (y = x W)
    bad = [k for k in (down.shape[2], down.shape[1]) if k % GROUP_SIZE["MXFP4"]]
    if bad:
        return None
    reason = (
        f"{d.precision} ({d.reason}); gpt-oss's layout: {d.name}.{{gate_up,down}}_proj_blocks "
        "and _scales"
    )
    return _Layer(d.name, torch.empty(0), False, reason, "MXFP4", spec, gpt_oss=True)


def _gpt_oss_tensors(layer: _Layer, key: str, value: torch.Tensor, seed: int) -> dict[str, Any]:
    """``<key>_blocks`` uint8 [E, N, K/32, 16] and ``<key>_scales`` uint8 [E, N, K/32] of a
    gpt-oss experts weight (``gate_up_proj`` [E, H, 2I] or ``down_proj`` [E, I, H], y = x W):
    each expert's [N, K] = W^T quantized as its fprop GEMM quantizes it (the GEMM's weight
    operand; gate and up rows interleaved as the model holds them)."""
    blocks, scales = [], []
    for e in range(value.shape[0]):
        one = _Layer(f"{layer.name}[{e}]", value[e].t(), False, "", layer.algo, layer.spec)
        parts = {k.rpartition(".")[2]: t for k, t in _quantized_tensors(one, seed).items()}
        packed, codes = parts["weight"], parts["weight_scale"]  # [N, K/2], [N, K/32]
        blocks.append(packed.reshape(packed.shape[0], codes.shape[1], -1))
        scales.append(codes)
    return {f"{key}_blocks": torch.stack(blocks), f"{key}_scales": torch.stack(scales)}


def _experts_tensors(
    layer: _Layer, key: str, value: torch.Tensor, seed: int, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The per-expert checkpoint tensors of one of an experts module's 3-D parameters
    (``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I]): each expert's slice quantized as
    its fprop GEMM quantizes it (the fused gate and up slice in one, so both halves keep the
    codes, block scales and global scale of training) and split into gate and up rows; or the
    slices in ``dtype`` where the layer is kept."""
    lay = layer.experts
    assert lay is not None
    fused = key.endswith(".gate_up_proj")
    out: dict[str, torch.Tensor] = {}
    # ``global per tensor``: every expert's slice with the amax of the whole parameter, as
    # training quantizes it (fp4gen.runtime.grouped_scope)
    scoped = layer.spec is not None and layer.spec.global_scope == "tensor"
    amax = value.detach().abs().amax().float() if scoped else None
    for e in range(lay.count):
        w = value[e]
        if layer.algo is None:
            t = w.detach().cpu()
            if dtype is not None:
                t = t.to(dtype)
            parts = {"weight": t.contiguous()}
        else:
            one = _Layer(f"{layer.name}[{e}]", w, False, "", layer.algo, layer.spec)
            quantized = _quantized_tensors(one, seed, amax)
            parts = {k.rpartition(".")[2]: t for k, t in quantized.items()}
        if not fused:
            out.update({f"{lay.layer(e, 2)}.{k}": t for k, t in parts.items()})
            continue
        for proj, rows in ((0, slice(0, lay.inner)), (1, slice(lay.inner, 2 * lay.inner))):
            for k, t in parts.items():
                # the global scale (a scalar) belongs to both halves; the rest is split by row
                piece = t if t.dim() == 0 else t[rows]
                out[f"{lay.layer(e, proj)}.{k}"] = piece.clone().contiguous()
    return out


def _quantized_tensors(
    layer: _Layer, seed: int, amax: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized layer (no input_scale); ``amax``: the global
    amax to quantize with in place of the weight's own (an experts weight per tensor)."""
    from dataclasses import replace

    from fp4gen.formats import BlockFormat
    from fp4gen.runtime.grouped_scope import quantize_scoped
    from fp4gen.runtime.quantize_dispatch import quantize  # the kernels on CUDA, as in training

    assert layer.spec is not None and layer.algo is not None
    fmt = layer.spec.format
    # exactly the forward GEMM's weight operand: the format with its (1D or 2D) blocks
    assert isinstance(fmt, BlockFormat)
    weight = layer.weight.detach().contiguous()  # a Conv1D weight.t() is a strided view
    try:
        if amax is not None:
            spec = replace(layer.spec, rht=None)  # the plain quantize below takes none either
            q = quantize_scoped(weight, spec, amax.to(weight.device), seed=seed, offset=0)
        else:
            q = quantize(weight, fmt, rounding=layer.spec.rounding, seed=seed)
    except TensorError as err:  # NaN or Inf in the weight: say which tensor of the model
        raise ExportError(
            f"{layer.name}.weight [{weight.shape[0]}, {weight.shape[1]}]: {err}"
        ) from None
    rows = q.rows
    codes = q.scale_codes
    assert codes is not None
    block_rows = min(q.format.block[0], rows)
    if block_rows > 1:
        # inference layouts hold one scale per row and K block: a tile's scale repeated over
        # its rows gives every element its own code and scale, so the values are unchanged
        codes = codes.repeat_interleave(block_rows, 0)[:rows]
    name = layer.name
    out: dict[str, torch.Tensor] = {}
    if layer.algo == "MXFP8":
        out[f"{name}.weight"] = q.codes.view(torch.float8_e4m3fn)
    else:
        out[f"{name}.weight"] = q.data  # two e2m1 codes per byte, element 0 in the low nibble
    if layer.algo == "NVFP4":
        out[f"{name}.weight_scale"] = codes.view(torch.float8_e4m3fn)
        # S_dec itself, the global decode scale the codes were made with (amax / 2688 up to
        # the rounding of 1 / fp32(2688 / amax)): a recomputed amax / 2688 could differ by an
        # ulp and then every decoded value would too
        out[f"{name}.weight_scale_2"] = q.global_scale.reshape(()).to(torch.float32)
    else:
        out[f"{name}.weight_scale"] = codes
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def _global_decode_scale(amax: float) -> float:
    """S_dec of NVFP4 for a tensor amax, by the quantizer's rule (docs/numerics.md 2)."""
    a = torch.tensor(amax, dtype=torch.float32)
    s_enc = torch.tensor(448.0 * 6.0, dtype=torch.float32) / a
    s_enc = torch.clamp(s_enc, max=torch.finfo(torch.float32).max)
    if amax == 0 or float(s_enc) == 0:
        return 1.0
    return float(1.0 / s_enc)


def _calibrate(
    model: nn.Module, names: list[str], samples: Iterable[Any], experts: Iterable[_Layer] = ()
) -> dict[str, float]:
    """Each named layer's input amax over the samples (a tensor: model(x); a tuple: model(*x);
    a mapping: model(**x)), run without gradients; and each expert's layers' (by their
    checkpoint names, ``_experts_amax``)."""
    modules = dict(model.named_modules())
    amax: dict[str, float] = {}
    hooks = []
    seen: dict[str, dict[tuple[int, int], float]] = {}
    swapped: list[tuple[nn.Module, str, nn.Module]] = []

    def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def record(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            value = float(x.detach().abs().amax().float()) if x.numel() else 0.0
            amax[name] = max(amax.get(name, 0.0), value)

        return record

    try:
        for name in names:
            hooks.append(modules[name].register_forward_pre_hook(hook(name)))
        for layer in experts:
            observer = _expert_observer(seen.setdefault(layer.name, {}))
            _observed_experts(modules, layer.name, observer, swapped)
        with torch.no_grad():
            for i, sample in enumerate(samples):
                try:
                    if isinstance(sample, Mapping):
                        model(**sample)
                    elif isinstance(sample, tuple | list):
                        model(*sample)
                    else:
                        model(sample)
                except (RuntimeError, IndexError, ValueError, TypeError) as err:
                    shape = list(sample.shape) if torch.is_tensor(sample) else type(sample).__name__
                    raise ExportError(
                        f"calibration: the model failed on sample {i} ({shape}): {_first(err)}"
                    ) from None
    finally:
        for h in hooks:
            h.remove()
        for module in modules.values():
            if getattr(module, "observe", None) is not None:
                module.observe = None
        for parent, leaf, original in swapped:
            setattr(parent, leaf, original)
    for layer in experts:
        amax.update(_experts_amax(layer, seen[layer.name]))
    missing = [n for n in names if n not in amax]
    if missing:
        raise ExportError(f"calibration: layer {missing[0]} saw no input in the samples given")
    bad = [n for n in amax if not math.isfinite(amax[n])]
    if bad:
        raise ExportError(f"calibration: the input of {bad[0]} holds NaN or Inf")
    return amax


def _expert_observer(
    seen: dict[tuple[int, int], float],
) -> Callable[[int, int, torch.Tensor], None]:
    def observe(expert: int, proj: int, x: torch.Tensor) -> None:
        value = float(x.detach().abs().amax().float()) if x.numel() else 0.0
        seen[(expert, proj)] = max(seen.get((expert, proj), 0.0), value)

    return observe


def _observed_experts(
    modules: Mapping[str, nn.Module],
    name: str,
    observer: Callable[[int, int, torch.Tensor], None],
    swapped: list[tuple[nn.Module, str, nn.Module]],
) -> None:
    """Have the experts module ``name`` report each expert's projection inputs to
    ``observer``: a converted model's ``GroupedExperts`` as it runs (its quantized forward); a
    transformers experts module through a ``GroupedExperts`` put in its place for the
    calibration, with every operand in the weights' own dtype, so that it computes what the
    module computes (its own torch GEMMs, bit for bit); ``swapped`` says what to put back."""
    from fp4gen.dsl import parse_recipe
    from fp4gen.runtime.experts import GroupedExperts, experts_layout

    module = modules[name]
    if not isinstance(module, GroupedExperts):
        layout = experts_layout(module)
        assert not isinstance(layout, str) and layout is not None  # experts_export checked it
        dtype = getattr(module, layout.up).dtype
        hp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        table = parse_recipe(f"operands {{\n * : {hp}\n}}\n", base_dir=None).operands
        stand_in = GroupedExperts(module, layout, operands=table, seed=0, name=name)
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else None
        if parent is None:
            raise ExportError(f"calibration: the experts module {name} is the model itself")
        setattr(parent, leaf, stand_in)
        swapped.append((parent, leaf, module))
        module = stand_in
    module.observe = observer


def _experts_amax(layer: _Layer, seen: Mapping[tuple[int, int], float]) -> dict[str, float]:
    """The input amax of each per-expert layer (gate and up: the expert's tokens; down: its
    activation). An expert no calibration token was routed to gets the largest of its module's
    experts (the scale an engine that keeps one input scale per layer takes anyway); every
    expert gets it where the inputs are quantized per tensor (one amax over every expert's
    tokens, docs/numerics.md 13)."""
    lay = layer.experts
    assert lay is not None
    widest = [max((v for (e, p), v in seen.items() if p == proj), default=None) for proj in (0, 1)]
    if widest[0] is None:
        raise ExportError(f"calibration: no token was routed to any expert of {layer.name}")
    out = {}
    for e in range(lay.count):
        for proj in (0, 1, 2):
            which = 0 if proj < 2 else 1
            own = None if layer.inputs_per_tensor else seen.get((e, which))
            out[lay.layer(e, proj)] = widest[which] if own is None else own  # type: ignore[assignment]
    return out


def _write_shards(
    tensors: dict[str, torch.Tensor], files: OutputFiles, max_bytes: int, metadata: dict[str, str]
) -> list[str]:
    """Write safetensors files, one or several of at most ``max_bytes`` (a tensor larger than
    that gets a file to itself) with Hugging Face's index file, and return their names."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes

    def save(shard: dict[str, torch.Tensor]) -> Callable[[Path], None]:
        def write(path: Path) -> None:
            try:
                save_file(shard, str(path), metadata=metadata)
            except SafetensorError as err:  # its I/O errors (a full disk) are no OSErrors
                raise OSError(_first(err)) from None

        return write

    if len(shards) == 1:
        files.write_with(SINGLE_FILE, save(shards[0]))
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        files.write_with(name, save(shard))
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    files.write_text(INDEX_FILE, json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


def export_quantized(
    model: nn.Module | Mapping[str, torch.Tensor],
    out_dir: str | Path,
    recipe: Recipe | str | None = None,
    *,
    calibration: Iterable[Any] | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    seed: int = 0,
) -> ExportReport:
    """Write ``model`` (an nn.Module, a model converted with ``fp4gen.convert``, or a plain
    state_dict) to ``out_dir`` as a checkpoint with the recipe's quantized linear layers.

    recipe: decides which linear layers are quantized (its layer rules: the plan of
        ``fp4gen.convert``) and in which format (each layer's fprop weight operand). Leave it
        out for a converted model: its own plan decides.
    calibration: sample inputs (tensors, argument tuples or keyword mappings, run through the
        model without gradients): each NVFP4 layer then gets ``input_scale``, the global
        decode scale of its input amax (amax / 2688 as the quantizer rounds it), and the
        checkpoint is W4A4 (quant_algo NVFP4). Without samples no input_scale is written and
        the NVFP4 layers are declared weight-only (quant_algo W4A16_NVFP4): a loader never
        quantizes activations with a scale that was not calibrated.
    dtype: the dtype of every tensor not quantized (embeddings, norms, biases, the layers kept
        in high precision); None keeps each as it is. Integer tensors keep theirs.
    max_shard_size: the largest safetensors file (bytes, or "5GB", "500MB"); past it the
        tensors go to numbered files with ``model.safetensors.index.json``, as Hugging Face
        writes them.
    overwrite: replace a checkpoint already in ``out_dir`` (its safetensors files, index,
        ``hf_quant_config.json``, ``config.json`` and ``generation_config.json``); without it
        a folder holding any of them is refused. Every file is written under a temporary name
        and all are renamed into place once each is whole, so an error (a full disk) leaves the
        folder as it was; a symbolic link where a file is to be written is refused.
    seed: the Philox seed of a stochastic rounding of the fprop weight (none of the shipped
        recipes rounds weights stochastically).

    gpt-oss experts quantized in MXFP4 are written in gpt-oss's own layout (``*_blocks``,
    ``*_scales``; config.json quant_method "mxfp4"), and then every other linear layer in high
    precision: gpt-oss's MXFP4 loaders (transformers, vLLM) read only the experts quantized.

    Layers whose K (in_features) is not a multiple of the group size (16 for NVFP4, 32 for MX)
    have no inference layout: they are written in high precision and listed as excluded.
    A transformers Conv1D (GPT-2) layer's quantized weight is written [out, in] (blocks run
    along K, the last dimension); ``hf_quant_config.json`` lists such layers under
    ``fp4gen.transposed_conv1d`` and ``import_quantized`` transposes them back.

    Raises ExportError (an FP4GenError) for a format with no checkpoint layout, a recipe that
    quantizes nothing, an output path that is a file or already holds a checkpoint.
    """
    try:
        import safetensors.torch  # noqa: F401  (needed below; say so before any work)
    except ImportError:
        raise ExportError(
            "exporting a checkpoint needs the safetensors package: pip install 'fp4gen[hf]'"
        ) from None
    from fp4gen import __version__

    out = Path(out_dir)
    config_files = (
        HF_CONFIG_FILES
        if callable(getattr(getattr(model, "config", None), "to_json_string", None))
        else ()
    )
    check_out_dir(out, overwrite, None, config_files)
    max_bytes = parse_size(max_shard_size)
    decisions, state = _decisions(model, recipe)
    modules = dict(model.named_modules()) if isinstance(model, nn.Module) else None
    layers = _layers(decisions, state, modules)
    gpt_oss = [layer for layer in layers if layer.gpt_oss]
    if gpt_oss:  # gpt-oss's MXFP4 checkpoint: its loaders read only the experts quantized
        for layer in layers:
            if layer.algo is not None and not layer.gpt_oss:
                layer.algo = None
                layer.reason = f"{GPT_OSS_DENSE_REASON} (trained as {layer.reason})"
    quantized = [layer for layer in layers if layer.algo is not None]
    if not quantized:
        raise ExportError(
            f"the recipe keeps all {len(layers)} linear layers in high precision: there is "
            "nothing to quantize (see fp4gen.show_plan, or a recipe whose layer rules leave "
            "some blocks quantized)"
        )
    input_scales: dict[str, float] = {}
    if calibration is not None:
        if not isinstance(model, nn.Module):
            raise ExportError("calibration needs a model to run: a state_dict has no forward")
        nvfp4 = [
            layer.name for layer in quantized if layer.algo == "NVFP4" and layer.experts is None
        ]
        # experts modules: each expert's own inputs (its tokens; its activation)
        moe = [layer for layer in quantized if layer.algo == "NVFP4" and layer.experts]
        amax = _calibrate(model, nvfp4, calibration, moe) if nvfp4 or moe else {}
        input_scales = {name: _global_decode_scale(a) for name, a in amax.items()}

    # every tensor in state_dict order; a quantized layer's weight replaced by its tensors
    by_weight = {f"{layer.name}.weight": layer for layer in quantized if layer.experts is None}
    experts = [layer for layer in layers if layer.experts is not None]
    by_expert_key = {
        f"{layer.name}.{p}": layer for layer in experts for p in ("gate_up_proj", "down_proj")
    }
    by_gpt_oss_key = {
        f"{layer.name}.{p}": layer for layer in gpt_oss for p in ("gate_up_proj", "down_proj")
    }
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in state.items():
        gpt_oss_layer = by_gpt_oss_key.get(key)
        if gpt_oss_layer is not None:
            tensors.update(_gpt_oss_tensors(gpt_oss_layer, key, value, seed))
            continue
        expert_layer = by_expert_key.get(key)
        if expert_layer is not None:
            tensors.update(_experts_tensors(expert_layer, key, value, seed, dtype))
            for name in expert_layer.names():  # the calibrated ones: gate, up, down per expert
                if name in input_scales and f"{name}.weight" in tensors:
                    scale = torch.tensor(input_scales[name], dtype=torch.float32)
                    tensors[f"{name}.input_scale"] = scale
            continue
        layer = by_weight.get(key)
        for moe in experts:  # a key inside a renamed MoE block (Mixtral's router)
            assert moe.experts is not None
            key = moe.experts.key(key)
        if layer is not None:
            tensors.update(_quantized_tensors(layer, seed))
            if layer.name in input_scales:
                scale = torch.tensor(input_scales[layer.name], dtype=torch.float32)
                tensors[f"{layer.name}.input_scale"] = scale
            continue
        t = value.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        # safetensors refuses tensors that share memory (tied embeddings and heads, views of
        # one fused tensor): a second name in a storage gets its own copy, so every key of the
        # state_dict is in the checkpoint
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[key] = t

    algos = {name: layer.algo for layer in quantized for name in layer.names() if layer.algo}
    distinct = sorted(set(algos.values()))
    quant_algo = distinct[0] if len(distinct) == 1 else "MIXED_PRECISION"
    # what the configs say per layer: an NVFP4 layer without an input_scale is weight-only,
    # never W4A4 (a loader would quantize its activations with a default or garbage scale)
    config_algos = {
        name: W4A16_NVFP4 if a == "NVFP4" and name not in input_scales else a
        for name, a in algos.items()
    }
    distinct_config = sorted(set(config_algos.values()))
    config_algo = distinct_config[0] if len(distinct_config) == 1 else "MIXED_PRECISION"
    excluded = [name for layer in layers if layer.algo is None for name in layer.names()]
    # the routers of the MoE blocks written per expert (a 2-D ``gate.weight``, never
    # quantized): named, as Model Optimizer names them, so no loader quantizes them
    excluded += [
        moe.experts.key(router)
        for moe in experts
        if moe.experts is not None
        and f"{(router := moe.name.rpartition('.')[0] + '.gate')}.weight" in state
    ]
    section: dict[str, Any] = {"quant_algo": config_algo}
    if config_algo == "MIXED_PRECISION":
        section["quantized_layers"] = {
            name: {"quant_algo": a, "group_size": GROUP_SIZE[LAYOUT[a]]}
            for name, a in config_algos.items()
        }
    else:
        section["group_size"] = GROUP_SIZE[LAYOUT[config_algo]]
    # Model Optimizer always writes the key (null: the KV cache is not quantized), and
    # vLLM's ModelOpt loader refuses an NVFP4 or MXFP8 hf_quant_config.json without it
    section["kv_cache_quant_algo"] = None
    section["exclude_modules"] = excluded
    producer = {"name": "fp4gen", "version": __version__}
    quant_config: dict[str, Any] = {"producer": producer, "quantization": section}
    conv1d = [layer.name for layer in quantized if layer.conv1d]
    ours: dict[str, Any] = {}
    if conv1d:
        ours["transposed_conv1d"] = conv1d
    if experts:
        ours["experts"] = [layer.experts.described() for layer in experts if layer.experts]
    if gpt_oss:
        ours["gpt_oss_experts"] = [layer.name for layer in gpt_oss]
    if ours:
        quant_config["fp4gen"] = ours

    files = OutputFiles(out, overwrite=overwrite)
    old = sorted({p.name for pat in _WEIGHT_FILES for p in out.glob(pat)}) if out.is_dir() else []
    try:
        with files.transaction():  # all files whole, or the folder as it was
            written = _write_shards(tensors, files, max_bytes, {"format": "pt"})
            files.write_text(QUANT_CONFIG, json.dumps(quant_config, indent=2) + "\n")
            written.append(QUANT_CONFIG)
            written += _write_hf_config(model, files, quant_config, config_algos, dtype)
            removed = [name for name in old if name not in written and files.remove(name)]
    except OutputError as err:
        raise ExportError(str(err)) from None
    replaced = [str(p.relative_to(out)) for p in files.replaced] + removed

    rows = tuple(
        (
            _row_name(layer),
            _written_as(layer, dtype, config_algos.get(layer.names()[0])),
            layer.reason,
        )
        for layer in layers
    )
    return ExportReport(
        out,
        quant_algo,
        rows,
        tuple(written),
        algos,
        tuple(excluded),
        tuple(replaced),
        config_algo,
        GPT_OSS_NOTE if gpt_oss else engine_note(config_algo),
    )


def _row_name(layer: _Layer) -> str:
    if layer.conv1d:
        return f"{layer.name} (Conv1D)"
    if layer.experts is not None:
        return f"{layer.name} ({layer.experts.count} experts)"
    return layer.name


def _written_as(layer: _Layer, dtype: torch.dtype | None, config_algo: str | None) -> str:
    if layer.algo is None:
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        return f"kept, {names.get(dtype, 'as stored') if dtype is not None else 'as stored'}"
    assert layer.spec is not None
    rows, cols = layer.spec.format.block  # type: ignore[union-attr]  # a BlockFormat here
    tiles = f", {rows}x{cols} tile scales per row" if rows > 1 else ""
    weight_only = " weights only (W4A16_NVFP4)" if config_algo == W4A16_NVFP4 else ""
    return f"{layer.algo}{weight_only}{tiles}"


def quantization_config(quant_config: dict[str, Any], algos: Mapping[str, str]) -> dict[str, Any]:
    """config.json's ``quantization_config``: hf_quant_config.json in the compressed-tensors
    form Model Optimizer writes there (config groups, ignore, quant_algo, producer, quant_method
    "modelopt"); ``algos`` maps each quantized layer to its checkpoint quant_algo. quant_method
    is "modelopt" only where an engine's ModelOpt loader reads the checkpoint (ENGINE_ALGOS),
    else "fp4gen", which no engine claims: it refuses the folder instead of misreading it. A
    checkpoint with gpt-oss experts in gpt-oss's MXFP4 layout gets gpt-oss's own entry instead
    (quant_method "mxfp4", modules_to_not_convert: the layers written in high precision)."""
    section = quant_config["quantization"]
    if quant_config.get("fp4gen", {}).get("gpt_oss_experts"):
        # gpt-oss's own form (its hub config.json), what its mxfp4 loaders read
        return {
            "modules_to_not_convert": list(section["exclude_modules"]),
            "quant_method": GPT_OSS_MXFP4,
        }
    quant_algo = section["quant_algo"]
    if quant_algo == "MIXED_PRECISION":
        groups = {}
        for i, algo in enumerate(sorted(set(algos.values()))):
            group = _group_config(algo)
            group["targets"] = sorted(name for name, a in algos.items() if a == algo)
            groups[f"group_{i}"] = group
    else:
        groups = {"group_0": {**_group_config(quant_algo), "targets": ["Linear"]}}
    out: dict[str, Any] = {"config_groups": groups}
    if quant_algo == "MIXED_PRECISION":
        out["quantized_layers"] = section["quantized_layers"]
    out["ignore"] = list(section["exclude_modules"])
    out["quant_algo"] = quant_algo
    out["producer"] = quant_config["producer"]
    out["quant_method"] = "modelopt" if quant_algo in ENGINE_ALGOS else NO_ENGINE
    return out


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _write_hf_config(
    model: Any,
    files: OutputFiles,
    quant_config: dict[str, Any],
    algos: Mapping[str, str],
    dtype: torch.dtype | None,
) -> list[str]:
    """config.json (and generation_config.json) of a transformers model, with its
    quantization_config; the names of the files written (none for a model without a Hugging
    Face config)."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return []
    data = json.loads(to_json(use_diff=False))
    data["quantization_config"] = quantization_config(quant_config, algos)
    dtype_name = _DTYPE_NAMES.get(dtype) if dtype is not None else None
    if dtype_name is not None:
        for key in ("dtype", "torch_dtype"):  # transformers 5 writes "dtype", 4.x "torch_dtype"
            if key in data:
                data[key] = dtype_name
    files.write_text("config.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "to_json_string"):
        # the text to_json_file writes, written whole by the output rules
        files.write_text("generation_config.json", generation.to_json_string(use_diff=True))
        return ["config.json", "generation_config.json"]
    return ["config.json"]


# ---------------------------------------------------------------------------------------------
# loading a model for the command line
# ---------------------------------------------------------------------------------------------


def load_source(path: str | Path) -> nn.Module | dict[str, torch.Tensor]:
    """A Hugging Face model folder (AutoModelForCausalLM, local files only, in its stored dtype)
    or a torch state_dict file (loaded with weights_only=True); ExportError, one line, for
    anything else."""
    src = Path(path)
    if not src.exists():
        raise ExportError(f"{src}: no such file or folder (give a model folder or a state_dict)")
    if src.is_dir():
        if not (src / "config.json").is_file():
            raise ExportError(f"{src}: not a Hugging Face model folder (it has no config.json)")
        try:
            import transformers
        except ImportError:
            raise ExportError(
                f"{src}: loading a model folder needs transformers: pip install 'fp4gen[hf]'"
            ) from None
        _check_safetensors(src)
        # "dtype" replaced "torch_dtype" in transformers 4.56; "auto" keeps the stored dtype
        major, minor = (int(p) for p in re.findall(r"\d+", transformers.__version__)[:2])
        kwargs = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": "auto"}
        logging = transformers.utils.logging
        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # its load report: the keys are checked below instead
        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                str(src), local_files_only=True, output_loading_info=True, **kwargs
            )
        except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as err:
            if _is_weights_only_refusal(err):
                raise ExportError(f"{src}: {_refused_pickle(err)}") from None
            raise ExportError(
                f"{src}: transformers could not load the model: {_first(err)}"
            ) from None
        finally:
            logging.set_verbosity(verbosity)
        _check_loaded_keys(src, info)
        return model
    try:
        data = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as err:  # zip and format errors: all say "not a state_dict"
        if _is_weights_only_refusal(err):
            raise ExportError(f"{src}: {_refused_pickle(err)}") from None
        raise ExportError(f"{src}: not a torch state_dict file ({_first(err)[:200]})") from None
    if isinstance(data, Mapping):
        for key in ("state_dict", "model"):  # a training checkpoint that wraps the state_dict
            inner = data.get(key)
            if isinstance(inner, Mapping) and not torch.is_tensor(inner):
                data = inner
                break
    if not isinstance(data, Mapping) or not data:
        raise ExportError(f"{src}: not a state_dict (a mapping of names to tensors)")
    bad = [k for k, v in data.items() if not torch.is_tensor(v)]
    if bad:
        raise ExportError(
            f"{src}: not a state_dict: {bad[0]!r} holds a {type(data[bad[0]]).__name__}, "
            "not a tensor"
        )
    return dict(data)


def load_calibration(path: str | Path, model: nn.Module | None = None) -> list[torch.Tensor]:
    """Calibration batches from a torch-saved tensor of token ids (loaded with
    weights_only=True): an integer tensor [N, B, T] is N batches of [B, T], one [B, T] is a
    single batch. ExportError, one line, for anything else, or for an id past the model's
    embedding table."""
    src = Path(path)
    if not src.is_file():
        raise ExportError(f"{src}: no such calibration file (give a torch-saved tensor of ids)")
    try:
        data = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as err:  # zip and format errors alike: not a tensor file
        if _is_weights_only_refusal(err):
            raise ExportError(f"{src}: {_refused_pickle(err)}") from None
        raise ExportError(f"{src}: not a torch-saved tensor ({_first(err)[:200]})") from None
    rule = "calibration data is an integer tensor of token ids, [N, B, T] (N batches) or [B, T]"
    if not torch.is_tensor(data):
        raise ExportError(f"{src}: holds a {type(data).__name__}; {rule}")
    if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
        raise ExportError(f"{src}: {data.dtype} {list(data.shape)}; {rule}")
    if data.dim() not in (2, 3) or data.numel() == 0:
        raise ExportError(f"{src}: shape {list(data.shape)}; {rule}")
    ids = data.long()
    embeddings = getattr(model, "get_input_embeddings", None)
    table = embeddings() if callable(embeddings) else None
    vocab = getattr(table, "num_embeddings", None)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (isinstance(vocab, int) and high >= vocab):
        bound = f"[0, {vocab})" if isinstance(vocab, int) else "non-negative"
        raise ExportError(f"{src}: token ids span [{low}, {high}]; the model's ids are {bound}")
    return list(ids) if ids.dim() == 3 else [ids]


def model_files(src: Path, written: Iterable[str]) -> list[str]:
    """The names of a model folder's other files (tokenizer, chat template, ...) that go next
    to the export: everything but weights and what the export writes itself."""
    skip = set(written)
    weights = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
    names = []
    for path in sorted(src.iterdir()):
        name = path.name
        if not path.is_file() or name in skip or name.startswith("."):
            continue
        if name.endswith(weights) or name.endswith(".index.json"):
            continue
        names.append(name)
    return names


def copy_model_files(
    src: Path, out: Path, written: Iterable[str], *, overwrite: bool = True
) -> tuple[list[str], list[str]]:
    """Copy ``model_files`` next to the export, each whole and never through a link; returns
    the names copied and those of them that replaced a file (``overwrite=False``: refused)."""
    files = OutputFiles(out, overwrite=overwrite)
    names = model_files(src, written)
    try:
        files.refuse_existing(names)
        for name in names:
            files.write_with(name, lambda path, name=name: shutil.copy2(src / name, path))
    except OutputError as err:
        raise ExportError(str(err)) from None
    return names, [p.name for p in files.replaced]


def _first(err: BaseException) -> str:
    """An exception's first line (its type's name when it has no text)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _is_weights_only_refusal(err: BaseException) -> bool:
    """torch.load(weights_only=True) refused a pickle for what it holds (not for its format)."""
    return isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in str(err)


def _refused_pickle(err: BaseException) -> str:
    """Why weights-only loading refused a pickle file, without torch's advice to load it with
    weights_only=False (that runs whatever code the file holds)."""
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|$)", str(err), flags=re.M)
    what = f" ({found.group(1).strip().rstrip('.')})" if found else ""
    return (
        f"a pickle file holding more than tensors{what}: weights-only loading refused it and "
        "nothing in it ran; loading it with weights_only=False would run whatever code it "
        "holds, so convert it to safetensors where its source is trusted"
    )


def _check_safetensors(folder: Path) -> None:
    """ExportError, one line, for a safetensors file of the folder that cannot be opened
    (truncated, or not safetensors), naming it."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise ExportError(
                f"{path}: not a whole safetensors file ({_first(err)}): truncated or damaged"
            ) from None


def _check_loaded_keys(src: Path, info: Mapping[str, Any]) -> None:
    """ExportError, one line, when the checkpoint's tensors do not match the model's: a missing
    one would be exported as the random values transformers initialized it with."""
    problems = []
    for key, what in (
        (
            "missing_keys",
            "missing from the checkpoint (transformers would initialize them randomly)",
        ),
        ("unexpected_keys", "in the checkpoint but not in the model"),
        ("mismatched_keys", "of another shape than the model's"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            problems.append(f"{len(names)} tensor(s) {what}: {shown}")
    if problems:
        raise ExportError(f"{src}: the checkpoint does not match its config: {'; '.join(problems)}")


# ---------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------


class QuantizedCheckpoint(NamedTuple):
    """What ``import_quantized`` returns: unpack it as ``state_dict, config``."""

    state_dict: dict[str, torch.Tensor]  # quantized layers' weights dequantized, scales gone
    config: dict[str, Any]  # hf_quant_config.json


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{folder}: holds no safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return tensors


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes [N, K], element 0 from the low nibble."""
    pairs = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return pairs.reshape(packed.shape[0], packed.shape[1] * 2)


def _ue8m0(codes: torch.Tensor) -> torch.Tensor:
    """ue8m0 codes -> fp32 2^(code - 127), built from the bits (exact, 2^-127 is subnormal);
    code 255 is NaN."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 1 << 22), c << 23)
    bits = torch.where(c == 255, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _expect(tensor: torch.Tensor, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise ExportError(
            f"{key}: expected {dtype} {list(shape)}, found {tensor.dtype} {list(tensor.shape)}"
        )


def _dequantize(algo: str, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 values of one quantized layer: fp32(fp32(value(code) * scale) * global), the
    quantizer's order (docs/numerics.md 2.7)."""
    key = f"{name}.weight"
    weight = tensors.get(key)
    scale = tensors[f"{name}.weight_scale"]
    if weight is None or weight.dim() != 2 or scale.dim() != 2:
        raise ExportError(f"{name}: a quantized layer needs a 2-D weight and weight_scale")
    group = GROUP_SIZE[algo]
    rows = weight.shape[0]
    cols = weight.shape[1] * (1 if algo == "MXFP8" else 2)
    if cols % group:
        raise ExportError(f"{key}: K={cols} is not a multiple of the {algo} group size {group}")
    if algo == "MXFP8":
        _expect(weight, key, torch.float8_e4m3fn, (rows, cols))
        values = weight.to(torch.float32)
    else:
        _expect(weight, key, torch.uint8, (rows, cols // 2))
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        values = table[_unpack_fp4(weight).long()]
    scale_dtype = torch.float8_e4m3fn if algo == "NVFP4" else torch.uint8
    _expect(scale, f"{name}.weight_scale", scale_dtype, (rows, cols // group))
    decoded = scale.to(torch.float32) if algo == "NVFP4" else _ue8m0(scale)
    out = values * decoded.repeat_interleave(group, dim=1)
    if algo == "NVFP4":
        key2 = f"{name}.weight_scale_2"
        global_scale = tensors.get(key2)
        if global_scale is None or global_scale.numel() != 1:
            raise ExportError(f"{key2}: an NVFP4 layer needs its fp32 global scale")
        out = out * global_scale.to(torch.float32).reshape(())
    return out


def import_quantized(path: str | Path, *, dtype: torch.dtype | None = None) -> QuantizedCheckpoint:
    """Read a checkpoint folder written by ``export_quantized`` (or Model Optimizer's NVFP4,
    MXFP8 or MXFP4 layout) into ``(state_dict, config)``.

    Every quantized layer's ``weight`` is dequantized to fp32 (bit for bit the values
    ``QuantizedTensor.dequantize()`` gave at export) and its scale tensors are consumed, so the
    state_dict loads into the original model; layers listed in ``fp4gen.transposed_conv1d`` are
    transposed back to Conv1D's [in, out]. Other tensors are returned as stored. ``dtype``
    casts the dequantized weights (None: fp32, exact). ``config`` is hf_quant_config.json.
    """
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ExportError(
            "reading a checkpoint needs the safetensors package: pip install 'fp4gen[hf]'"
        ) from None
    folder = Path(path)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "no such folder"
        raise ExportError(f"{folder}: {what}: give the folder export_quantized wrote")
    config_path = folder / QUANT_CONFIG
    if not config_path.is_file():
        raise ExportError(f"{folder}: not a quantized checkpoint (it has no {QUANT_CONFIG})")
    try:
        config = json.loads(config_path.read_text())
        section = config["quantization"]
        quant_algo = section["quant_algo"]
    except (ValueError, KeyError, TypeError) as err:
        raise ExportError(f"{config_path}: not a valid {QUANT_CONFIG} ({err})") from None
    per_layer: dict[str, str] = {}
    if quant_algo == "MIXED_PRECISION":
        per_layer = {n: c["quant_algo"] for n, c in section.get("quantized_layers", {}).items()}
    elif quant_algo not in LAYOUT:
        raise ExportError(
            f"{config_path}: quant_algo {quant_algo!r} is not one fp4gen reads "
            f"({', '.join(LAYOUT)} or MIXED_PRECISION)"
        )
    transposed = set(config.get("fp4gen", {}).get("transposed_conv1d", ()))

    tensors = _read_tensors(folder)
    layers = [k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")]
    out = dict(tensors)
    for name in layers:
        algo = per_layer.get(name, quant_algo)
        if algo not in LAYOUT:
            raise ExportError(f"{name}: quant_algo {algo!r} is not one fp4gen reads")
        values = _dequantize(LAYOUT[algo], name, tensors)
        if name in transposed:
            values = values.t().contiguous()
        for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
            out.pop(f"{name}.{suffix}", None)
        out[f"{name}.weight"] = values if dtype is None else values.to(dtype)
    for described in config.get("fp4gen", {}).get("experts", ()):
        out = _fused_experts(out, described, f"{config_path}")
    for module in config.get("fp4gen", {}).get("gpt_oss_experts", ()):
        for proj in ("gate_up_proj", "down_proj"):
            values = _gpt_oss_weight(out, f"{module}.{proj}")
            out[f"{module}.{proj}"] = values if dtype is None else values.to(dtype)
    return QuantizedCheckpoint(out, config)


def _gpt_oss_weight(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """A gpt-oss experts weight in the model's [E, K, N] (y = x W), fp32, from its MXFP4
    ``<key>_blocks`` [E, N, K/32, 16] and ``<key>_scales`` [E, N, K/32] (both consumed)."""
    blocks, scales = tensors.pop(f"{key}_blocks", None), tensors.pop(f"{key}_scales", None)
    if blocks is None or scales is None:
        raise ExportError(f"{key}: gpt-oss's MXFP4 experts need {key}_blocks and {key}_scales")
    if blocks.dim() != 4 or blocks.shape[3] != 16 or tuple(blocks.shape[:3]) != tuple(scales.shape):
        raise ExportError(
            f"{key}_blocks {list(blocks.shape)} and {key}_scales {list(scales.shape)}: expected "
            "[E, N, K/32, 16] and [E, N, K/32]"
        )
    _expect(blocks, f"{key}_blocks", torch.uint8, tuple(blocks.shape))
    _expect(scales, f"{key}_scales", torch.uint8, tuple(scales.shape))
    experts, rows, groups = scales.shape
    packed = blocks.reshape(experts * rows, groups * 16)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = table[_unpack_fp4(packed).long()].reshape(experts, rows, groups * 32)
    values = values * _ue8m0(scales).repeat_interleave(32, dim=2)
    return values.transpose(1, 2).contiguous()


def _fused_experts(
    tensors: dict[str, torch.Tensor], described: Mapping[str, Any], where: str
) -> dict[str, torch.Tensor]:
    """The state_dict with one experts module's per-expert 2-D weights put back into the 3-D
    parameters the model holds (``gate_up_proj`` = cat(gate, up) [E, 2I, H], ``down_proj``
    [E, H, I]) under the model's names (the MoE block renamed back)."""
    try:
        module, count = str(described["module"]), int(described["experts"])
        names, prefix = [str(n) for n in described["names"]], str(described["prefix"])
        block = described["block"]
    except (KeyError, TypeError, ValueError) as err:
        raise ExportError(f"{where}: a malformed fp4gen.experts entry ({err})") from None
    lay = ExpertsLayout(module, count, (names[0], names[1], names[2]), prefix, None, 0)
    gate_up, down = [], []
    for e in range(count):
        try:
            gate, up, dn = (tensors.pop(f"{lay.layer(e, p)}.weight") for p in range(3))
        except KeyError as err:
            raise ExportError(f"{where}: expert tensor {err} is missing") from None
        gate_up.append(torch.cat([gate, up]))
        down.append(dn)
    out = {}
    back = None if block is None else (str(block[1]), str(block[0]))
    for key, value in tensors.items():
        if back is not None and key.startswith(back[0] + "."):
            key = back[1] + key[len(back[0]) :]
        out[key] = value
    out[f"{module}.gate_up_proj"] = torch.stack(gate_up)
    out[f"{module}.down_proj"] = torch.stack(down)
    return out


load_quantized = import_quantized

__all__ = [
    "EXPORTABLE",
    "ExportError",
    "ExportReport",
    "QuantizedCheckpoint",
    "export_algo",
    "engine_note",
    "export_quantized",
    "import_quantized",
    "load_calibration",
    "load_quantized",
    "load_source",
    "parse_size",
    "quantization_config",
    "skeleton",
]
