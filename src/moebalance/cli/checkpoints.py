"""`moebalance convert` and `export`: checkpoints in and out of transformers' layout."""

from __future__ import annotations

import argparse


def _convert(args) -> int:
    """Import a DeepSeek-V4 checkpoint (DeepSeek's release or either transformers layout,
    dequantising FP8/FP4) and write it in transformers' layout in float32 or bfloat16."""
    from moebalance import hf

    config, model = hf.load(args.src, weight_dtype=args.dtype)
    hf.save(model, config, args.dst)
    print(f"wrote {args.dst} ({config.base_num_decoder_layers} layers, {args.dtype})")
    return 0


def _export(args) -> int:
    """Write a run's checkpoint and tokenizer as a directory transformers loads."""
    from moebalance.hf.export import export

    result = export(args.run_dir, args.out, step=args.step, dtype=args.dtype,
                    overwrite=args.overwrite)
    print(f"wrote {args.out} (step {result['step']}, {result['dtype']}, "
          f"{'with' if result['tokenizer'] else 'no'} tokenizer)")
    return 0


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """The subcommands convert and export."""
    convert = sub.add_parser("convert", parents=[common],
                             help="re-export a DeepSeek-V4 checkpoint (DeepSeek's or "
                             "transformers' layout, FP8/FP4 dequantised) for transformers")
    convert.add_argument("src", help="directory with config.json and *.safetensors")
    convert.add_argument("dst", help="new directory to write (must not hold a checkpoint)")
    convert.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    convert.set_defaults(func=_convert)
    export = sub.add_parser("export", parents=[common],
                            help="write a run's checkpoint and tokenizer as a directory that "
                                 "transformers' AutoModelForCausalLM and AutoTokenizer load")
    export.add_argument("run_dir", help="a run directory with a checkpoint")
    export.add_argument("out", help="new directory to write (must not hold files)")
    export.add_argument("--step", type=int, default=None,
                        help="the checkpoint of this step (default: the latest)")
    export.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="weight dtype (default: the run's weight_dtype)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in OUT")
    export.set_defaults(func=_export)
