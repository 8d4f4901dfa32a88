"""``megatron-grpo`` command line: train, make-tiny-model, parity-demo.

Heavy imports (megatron.core, vLLM) happen inside the sub-commands, so ``--help`` and
config validation stay fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional


def _make_tiny_model(args) -> int:
    from megatron_grpo.models.tiny import make_tiny_model

    path = make_tiny_model(args.out_dir, args.arch, seed=args.seed, tie_word_embeddings=args.tie_word_embeddings)
    print(f"wrote tiny {args.arch} checkpoint to {path}")
    return 0


def _parity_demo(args) -> int:
    """Loads an HF Qwen3 checkpoint into Megatron-Core and compares logits with transformers."""
    import torch
    import transformers

    from megatron_grpo.models import build_from_hf, forward_logits
    from megatron_grpo.models.tiny import default_model_dir
    from megatron_grpo.parallel import state

    model_dir = args.model or default_model_dir()
    state.initialize_model_parallel(state.Layout(world_size=1))
    model, shape = build_from_hf(model_dir)
    ids = torch.randint(0, shape.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = forward_logits(model, ids)
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids).logits
    diff = (ours - ref).abs().max().item()
    print(f"model {model_dir}: Megatron-Core vs transformers logits max |diff| = {diff:.3e}")
    return 0 if diff <= 1e-4 else 1


def _train(args) -> int:
    from megatron_grpo.train import main as train_main

    return train_main(args.recipe, args.overrides, dry_run=args.dry_run, world_size=args.world_size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-grpo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run GRPO from a recipe YAML (under torchrun for several ranks)")
    train.add_argument("recipe", help="recipe YAML, e.g. recipes/grpo-tiny-eos-cpu.yaml")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.max_num_steps=3")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config and layout, build nothing")
    train.add_argument("--world-size", type=int, default=None,
                       help="with --dry-run: validate the layout for this many ranks (default: $WORLD_SIZE or 1)")
    train.set_defaults(func=_train)
    tiny = sub.add_parser("make-tiny-model", help="write a random-init tiny Qwen3(-MoE) HF checkpoint + tokenizer")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", choices=["qwen3", "qwen3-moe"], default="qwen3")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--tie-word-embeddings", action="store_true")
    tiny.set_defaults(func=_make_tiny_model)
    demo = sub.add_parser("parity-demo", help="Megatron-Core vs transformers logits on a checkpoint")
    demo.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded tiny model)")
    demo.set_defaults(func=_parity_demo)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
