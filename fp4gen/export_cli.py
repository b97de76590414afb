"""The ``fp4gen export`` command (registered by ``fp4gen.cli``); the work is in fp4gen.export."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

from fp4gen.errors import FP4GenError

EXPORT_EPILOG = """\
what is written to DIR:
  model.safetensors (or model-0000N-of-0000M.safetensors and model.safetensors.index.json):
    NVFP4 layer: <name>.weight uint8 [N, K/2] (two e2m1 codes per byte, element 0 in the low
      nibble), <name>.weight_scale float8_e4m3fn [N, K/16], <name>.weight_scale_2 fp32 scalar
      (the global decode scale), with --calibrate <name>.input_scale fp32 scalar; NVIDIA Model
      Optimizer's unified checkpoint layout, quant_algo NVFP4 (W4A4) with --calibrate, else
      W4A16_NVFP4 (weights only: no activation scale is claimed that was not calibrated)
    MXFP8 / MXFP4 layer: <name>.weight float8_e4m3fn [N, K] / uint8 [N, K/2], and
      <name>.weight_scale uint8 [N, K/32] (ue8m0 exponent codes); the OCP MX layout
    gpt-oss experts in MXFP4: gpt-oss's own layout, <experts>.gate_up_proj_blocks uint8
      [E, 2I, H/32, 16] and _scales uint8 [E, 2I, H/32], down_proj_blocks / _scales likewise;
      config.json quant_method mxfp4 (transformers' Mxfp4 quantizer and vLLM's gpt-oss loader
      read it) and every other linear layer in high precision, as those loaders read them
    every other tensor as it is, in --dtype
  hf_quant_config.json: quant_algo, group_size, kv_cache_quant_algo (null) and
    exclude_modules (the layers kept in high precision); config.json with quantization_config
    (quant_method modelopt for NVFP4, W4A16_NVFP4 and MXFP8, which vLLM's ModelOpt loader reads;
    fp4gen for MXFP4 and mixed formats, which no engine loads), and the model folder's
    tokenizer files

examples:
  fp4gen export my-llama/ --recipe nvfp4_small --out my-llama-nvfp4
  fp4gen export my-llama/ --recipe nvfp4_small --out my-llama-w4a4 --calibrate ids.pt
  fp4gen export weights.pt --recipe recipes/mxfp8.fp4r --out weights-mxfp8 --dtype keep

--calibrate DATA: torch.save(ids) of an integer tensor of token ids, [N, B, T] (N batches of
  B sequences of T tokens) or [B, T]; each batch runs through the model once, without
  gradients, and each NVFP4 layer's input_scale is amax / 2688 over all of them
"""

DTYPES = ("bf16", "fp16", "fp32", "keep")


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from fp4gen.dsl import load_recipe
    from fp4gen.export import (
        HF_CONFIG_FILES,
        check_out_dir,
        copy_model_files,
        export_quantized,
        load_calibration,
        load_source,
        model_files,
        parse_size,
    )

    for flag, value in (("MODEL", args.model), ("--out", args.out)):
        if "\0" in value:
            raise FP4GenError(f"{flag} {value!r}: a path holds no NUL byte")
    source, out = Path(args.model), Path(args.out)
    # the cheap checks first: a bad recipe or output folder fails before a model loads
    recipe = load_recipe(args.recipe)
    parse_size(args.max_shard_size)
    folder = source if source.is_dir() else None
    # a model folder brings config.json and generation_config.json, and its other files
    also = [*HF_CONFIG_FILES, *model_files(source, HF_CONFIG_FILES)] if folder else []
    check_out_dir(out, args.overwrite, folder, also)
    if args.calibrate is not None and folder is None:
        raise FP4GenError(
            f"--calibrate {args.calibrate}: calibration runs the model, and {source} is a "
            "state_dict (no forward): export its model folder instead"
        )
    if args.calibrate is not None:
        load_calibration(args.calibrate)  # a bad file fails before the model loads
    if source.is_dir():
        try:  # a command prints its own summary: no loading progress bars on stderr
            import transformers

            transformers.utils.logging.disable_progress_bar()
        except ImportError:
            pass  # load_source says what to install
    model = load_source(source)
    calibration = None
    if args.calibrate is not None:
        assert isinstance(model, torch.nn.Module)  # a folder loads a model (checked above)
        calibration = load_calibration(args.calibrate, model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype)
    report = export_quantized(
        model,
        out,
        recipe,
        calibration=calibration,
        dtype=dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )
    files = list(report.files)
    replaced = list(report.replaced)
    if source.is_dir():
        copied, also_replaced = copy_model_files(
            source, out, report.files, overwrite=args.overwrite
        )
        files += copied
        replaced += also_replaced
    print(report.table())
    print()
    kept = len(report.excluded)
    print(
        f"wrote {out}: {report.quant_algo}, {len(report.quantized)} linear layers quantized, "
        f"{kept} kept in high precision (exclude_modules)"
    )
    print(f"checkpoint: {report.engine}")
    print(f"files: {', '.join(files)}")
    if replaced:  # only with --overwrite
        print(f"replaced {len(replaced)} existing file(s) in {out}: {', '.join(replaced)}")
    return 0


def add_commands(sub: Any) -> None:
    """Register ``export`` on the CLI's subparsers."""
    p = sub.add_parser(
        "export",
        help="write a model as an NVFP4 / MXFP8 / MXFP4 checkpoint inference engines load",
        description=textwrap.fill(
            "Quantize a model's linear layers as a recipe trains them and write a "
            "Hugging Face checkpoint folder in the layout inference engines load: NVFP4 as NVIDIA "
            "Model Optimizer's unified checkpoint, MXFP8 and MXFP4 in the OCP MX layout. The "
            "recipe's layer rules decide which layers are quantized (as fp4gen.convert does); the "
            "rest are written in high precision and listed in exclude_modules. Each layer's format "
            "is its fprop weight operand; 16x16 (2D) weight blocks are written with the tile scale "
            "repeated per row, which decodes to the same values bit for bit. Read it back with "
            "fp4gen.import_quantized.",
            width=92,
        ),
        epilog=EXPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL_DIR|STATE_DICT",
        help="a Hugging Face model folder (loaded with AutoModelForCausalLM from local files, "
        "no download) or a torch state_dict file (loaded with weights_only=True)",
    )
    p.add_argument(
        "--recipe",
        required=True,
        metavar="R",
        help="the training recipe: an .fp4r path or a shipped name (nvfp4_small)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the output folder")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bf16",
        help="dtype of the tensors not quantized (keep: as stored; default: bf16)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors file, e.g. 5GB or 500MB (default: 5GB)",
    )
    p.add_argument(
        "--calibrate",
        metavar="DATA",
        help="a torch-saved integer tensor of token ids, [N, B, T] (N batches) or [B, T]: run "
        "through the model to give each NVFP4 layer its input_scale (W4A4); without it NVFP4 "
        "is written weights-only (W4A16_NVFP4)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a checkpoint already in DIR (its safetensors files, configs and the "
        "model folder's files it copies); without it such a DIR is refused",
    )
    p.set_defaults(func=cmd_export)
