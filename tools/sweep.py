"""Sweep the write-up's experiment table: runs x seeds, then ``summary.md`` + ``summary.csv``.

Each run is a recipe plus ``key=value`` overrides (params dtype x compute dtype x
generation dtype x learning rate x loss variant). Runs go in sequence on this machine,
each as its own ``megatron-grpo train`` process (``--nproc N`` wraps it in torchrun).
Resumable: a run whose ``metrics.jsonl`` already has all its steps is not redone.

    python tools/sweep.py --grid tiny-phantom --out runs/sweep-tiny --seeds 0 1 2
    python tools/sweep.py --grid tiny-moe-routing --out runs/moe-routing --seeds 0 1 --steps 10
    python tools/sweep.py --grid loss-families --out runs/loss-families --seeds 0 --steps 10
    python tools/sweep.py --grid writeup --out runs/sweep-0.6b --nproc 8      # on a GPU node
    python tools/sweep.py --grid writeup-pretrained --out runs/writeup-pretrained   # issue 16, see writeup.py
    python tools/sweep.py --grid writeup-regime --out runs/writeup-regime   # issue 26, see writeup_regime.py
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Sequence

import writeup
import writeup_regime
from writeup import read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tiny-phantom runs use recipes/grpo-tiny-phantom-cpu.yaml, whose clip epsilon is scaled to the
# tiny model's measured beta (see that recipe and docs/results/tiny-phantom.md).
_TINY = "recipes/grpo-tiny-phantom-cpu.yaml"
_FP32_VS_BF16 = ["policy.precision.compute_dtype=float32", "policy.precision.generation_dtype=bfloat16"]
_EP1 = ["policy.megatron_cfg.expert_model_parallel_size=1"]
_BF16_MATCHED = ["policy.precision.compute_dtype=bfloat16", "policy.precision.generation_dtype=bfloat16"] + _EP1
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
    # the write-up's table + loss families on the locally pretrained model, one run per (variant, lr)
    "writeup-pretrained": writeup.grid(),
    # issue 26: pre-registered A vs B + dose-response, megatron generator, synchronous, gated probes
    "writeup-regime": writeup_regime.grid(),
}
RECIPES = {"writeup-pretrained": writeup.RECIPE, "writeup-regime": writeup.RECIPE, "tiny-phantom": _TINY, "loss-families": _TINY, "tiny-moe-routing": "recipes/grpo-tiny-moe-ep2-cpu.yaml"}
COLUMNS = ["run", "seeds", "final_reward", "best_reward", "steps_to_threshold", "beta_abs_mean",
           "phantom_fraction_steps_1_5", "phantom_zero_grad_steps_1_5", "phantom_truncated_steps_1_5",
           "zero_grad_fraction_mean", "deployed_improvement_mean", "kl_rollout_max",
           "route_mismatch_fraction", "tokens_any_mismatch", "beta_abs_mean_route_mismatch"]


def recipe_for(grid: str, run: str) -> str:
    return RECIPES.get(grid) or f"recipes/grpo-qwen3-0.6b-eos-{run}.yaml"


def command(grid: str, run: str, seed: int, log_dir: str, steps: int, nproc: int, extra: Sequence[str],
            pre: Sequence[str] = ()) -> List[str]:
    """The run's command line; ``pre`` overrides go before the run's own (which win), ``extra`` after."""
    launcher = [sys.executable, "-m", "megatron_grpo"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "megatron_grpo"]
    overrides = list(pre) + GRIDS[grid][run] + [f"grpo.seed={seed}", f"logger.log_dir={log_dir}", "logger.progress_bar=false"]
    if steps:
        overrides.append(f"grpo.max_num_steps={steps}")
    return launcher + ["train", recipe_for(grid, run)] + overrides + list(extra)


def run_one(cmd: List[str], log_dir: str, expected_steps: int) -> bool:
    """Runs one training job unless its metrics are complete; returns True if it is complete."""
    rows = read_rows(log_dir)
    if expected_steps and len(rows) >= expected_steps:
        print(f"[sweep] done already: {log_dir}")
        return True
    os.makedirs(log_dir, exist_ok=True)
    print("[sweep] " + " ".join(cmd), flush=True)
    started = time.perf_counter()
    with open(os.path.join(log_dir, "train.log"), "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    with open(os.path.join(log_dir, "process.json"), "w") as f:  # launch to exit, imports included
        json.dump({"process_wall_s": time.perf_counter() - started, "returncode": code}, f)
    if code != 0:
        print(f"[sweep] FAILED ({code}): see {os.path.join(log_dir, 'train.log')}", flush=True)
    return code == 0


def _series(rows, key):
    return [r[key] for r in rows if r.get(key) is not None]


def summarize_seed(rows: List[dict], threshold: float) -> Dict[str, float]:
    """The table's numbers for one seed's metrics rows."""
    rewards = _series(rows, "reward/mean")
    reach = [r["step"] for r in rows if r.get("reward/mean") is not None and r["reward/mean"] >= threshold]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "final_reward": rewards[-1] if rewards else float("nan"),
        "best_reward": max(rewards) if rewards else float("nan"),
        "steps_to_threshold": float(reach[0]) if reach else float("nan"),
        "beta_abs_mean": mean(_series(rows, "precision/beta_abs_mean")),
        "phantom_fraction_steps_1_5": mean(_series([r for r in rows if r["step"] <= 5], "clip/phantom_region_fraction")),
        "phantom_zero_grad_steps_1_5": mean(_series([r for r in rows if r["step"] <= 5],
                                                    "clip/phantom_zero_grad_fraction")),
        "phantom_truncated_steps_1_5": mean(_series([r for r in rows if r["step"] <= 5],
                                                    "clip/phantom_truncated_fraction")),
        "zero_grad_fraction_mean": mean(_series(rows, "clip/zero_grad_fraction")),
        "deployed_improvement_mean": mean(_series(rows, "policy/deployed_improvement")),
        "kl_rollout_max": max(_series(rows, "policy/kl_rollout"), default=float("nan")),
        "route_mismatch_fraction": mean(_series(rows, "moe/route_mismatch_fraction")),
        "tokens_any_mismatch": mean(_series(rows, "moe/tokens_any_mismatch")),
        "beta_abs_mean_route_mismatch": mean(_series(rows, "precision/beta_abs_mean_route_mismatch")),
    }


def _fmt(values: List[float]) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "n/a"
    if len(finite) == 1:
        return f"{finite[0]:.4g}"
    return f"{statistics.mean(finite):.4g} ± {statistics.stdev(finite):.2g}"


def write_summary(out: str, grid: str, runs: Sequence[str], seeds: Sequence[int], threshold: float) -> List[dict]:
    table = []
    for run in runs:
        per_seed = [summarize_seed(read_rows(os.path.join(out, run, f"seed{s}")), threshold) for s in seeds]
        per_seed = [p for p in per_seed if not math.isnan(p["final_reward"])]
        row = {"run": run, "seeds": len(per_seed)}
        row.update({k: _fmt([p[k] for p in per_seed]) for k in COLUMNS[2:]})
        table.append(row)
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(f"# Sweep `{grid}` (mean ± std over seeds; reward threshold {threshold})\n\n")
        f.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
        for row in table:
            f.write("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |\n")
    return table


def run_pairs(grid: str, out: str, pairs, steps: int, nproc: int, extra: Sequence[str],
              pre: Sequence[str] = ()) -> bool:
    """Runs (run, seed) pairs in order, each resumable; True if all completed."""
    ok = True
    for run, seed in pairs:
        log_dir = os.path.abspath(os.path.join(out, run, f"seed{seed}"))
        ok &= run_one(command(grid, run, seed, log_dir, steps, nproc, extra, pre), log_dir, steps)
    return ok


def run_writeup(args) -> int:
    """``--grid writeup-pretrained`` without ``--runs``: model, lr scan, table, families, report (writeup.py)."""
    t0, steps = time.perf_counter(), args.steps or 30
    writeup.ensure_model()
    probe = (writeup.run_name("B", writeup.LRS[0]), 0)
    ok = args.summary_only or run_pairs(args.grid, os.path.join(args.out, "_gap-probe"), [probe],
                                        writeup.PROBE_STEPS, args.nproc, args.overrides)
    eps = writeup.choose_eps(read_rows(os.path.join(args.out, "_gap-probe", probe[0], "seed0")))
    pre = [f"loss_fn.ratio_clip_min={eps:.4g}", f"loss_fn.ratio_clip_max={eps:.4g}"]
    print(f"[sweep] clip eps {eps:.4g} (the write-up's 0.2 scaled by the measured beta std)", flush=True)
    scan = writeup.plan(args.scan_seeds, args.seeds, None, scan_lrs=args.scan_lrs)["lr-scan"]
    ok &= args.summary_only or run_pairs(args.grid, args.out, scan, steps, args.nproc, args.overrides, pre)
    finals = {run: {s: writeup.final_reward(read_rows(os.path.join(args.out, run, f"seed{s}")))
                    for s in args.scan_seeds} for run in {r for r, _ in scan}}
    table_lr = writeup.choose_lr(finals, args.scan_lrs) if args.table_lr == "auto" else float(args.table_lr)
    stages = writeup.plan(args.scan_seeds, args.seeds, table_lr, args.family_seeds, args.scan_lrs)
    for stage in ("table", "families"):
        print(f"[sweep] stage {stage} at lr {table_lr:g}", flush=True)
        if not args.summary_only:
            ok &= run_pairs(args.grid, args.out, stages[stage], steps, args.nproc, args.overrides, pre)
    runs = list(dict.fromkeys(r for pairs in stages.values() for r, _ in pairs))
    seeds = sorted(set(args.seeds) | set(args.scan_seeds) | set(args.family_seeds or ()))
    write_summary(args.out, args.grid, runs, seeds, args.threshold)
    doc = writeup.write_report(args.out, table_lr, args.scan_seeds, args.seeds, args.threshold,
                               wall_s=None if args.summary_only else time.perf_counter() - t0, eps=eps,
                               family_seeds=args.family_seeds, scan_lrs=args.scan_lrs)
    print(f"[sweep] wrote {doc}")
    return 0 if ok else 1


def run_regime(args) -> int:
    """``--grid writeup-regime`` without ``--runs``: scout -> eps -> gate probes -> main -> dose, the page after
    each (writeup_regime.py); a failed gate stops before the main stage unless ``--run-flagged``."""
    reg, out = writeup_regime, args.out
    run = lambda stage, pairs, steps, pre=(): args.summary_only or run_pairs(  # noqa: E731
        args.grid, os.path.join(out, stage), pairs, steps, args.nproc, args.overrides, pre)
    writeup.ensure_model()
    os.makedirs(out, exist_ok=True)
    ok = run("probe", [("scout-B", 0)], reg.PROBE_STEPS)
    choice = reg.choose_eps(reg.load_log_ratios(os.path.join(out, "probe", "scout-B", "seed0")))
    print(f"[sweep] main eps {choice['eps']:.4g}, dose eps "
          + ", ".join(f"{r} {choice['eps_' + r]:.4g}" for r in reg.DOSE_TARGETS), flush=True)
    ok &= run("gates", [("probe-A", 0), ("probe-B", 0)], reg.PROBE_STEPS, reg.eps_overrides(choice["eps"]))
    gates = reg.gates(read_rows(os.path.join(out, "gates", "probe-A", "seed0")),
                      read_rows(os.path.join(out, "gates", "probe-B", "seed0")))
    passed = all(g[1] for g in gates)
    reg.save_state(out, eps_choice=choice, gates=gates, estimate=reg.estimate_wall(out),
                   flagged=not passed and args.run_flagged)
    for name, good, measured in gates:
        print(f"[sweep] gate {'pass' if good else 'FAIL'}: {name}: {measured}", flush=True)
    reg.write_page(out)
    if args.stage == "probe" or not (passed or args.run_flagged):
        print(f"[sweep] wrote {os.path.join(out, 'writeup-regime.md')}" + ("" if passed else " (gates failed)"))
        return 0 if ok and passed else 1
    for stage in ("main", "dose"):
        runs, seeds, steps = reg.STAGES[stage]
        for seed in seeds:  # seed-major: a partial stage still has complete pairs
            for name in runs:
                ok &= run(stage, [(name, seed)], steps, reg.eps_overrides(choice.get(f"eps_{name}", choice["eps"])))
                reg.write_page(out)
    print(f"[sweep] wrote {reg.write_page(out)}")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", choices=sorted(GRIDS), default="tiny-phantom")
    parser.add_argument("--out", required=True, help="sweep folder (run/seedK/metrics.jsonl, summary.*)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=0, help="override grpo.max_num_steps (0 = the recipe's)")
    parser.add_argument("--runs", nargs="*", default=None, help="subset of the grid's runs")
    parser.add_argument("--threshold", type=float, default=-4.0, help="reward counted as 'reached'")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun)")
    parser.add_argument("--summary-only", action="store_true", help="rewrite summary.* from existing metrics")
    parser.add_argument("--scan-seeds", type=int, nargs="+", default=[0],
                        help="writeup-pretrained: seeds of the lr scan (A, B at every lr)")
    parser.add_argument("--table-lr", default="auto",
                        help="writeup-pretrained: lr of the table and families stages (auto: from the scan)")
    parser.add_argument("--scan-lrs", type=float, nargs="+", default=list(writeup.LRS),
                        help=f"writeup-pretrained: lrs of the scan (a subset of {list(writeup.LRS)})")
    parser.add_argument("--family-seeds", type=int, nargs="+", default=None,
                        help="writeup-pretrained: seeds of the loss-family runs (default: --seeds)")
    parser.add_argument("--stage", choices=("probe", "all"), default="all",
                        help="writeup-regime: stop after the probe stage, or go on to main + dose if the gates pass")
    parser.add_argument("--run-flagged", action="store_true",
                        help="writeup-regime: run main + dose even if a gate fails (the page flags them)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.grid == "writeup-pretrained" and not args.runs:
        return run_writeup(args)
    if args.grid == "writeup-regime" and not args.runs:
        return run_regime(args)
    runs = args.runs or list(GRIDS[args.grid])
    unknown = [r for r in runs if r not in GRIDS[args.grid]]
    if unknown:
        parser.error(f"unknown runs {unknown}; grid {args.grid} has {list(GRIDS[args.grid])}")
    ok = True
    if not args.summary_only:
        for run in runs:
            for seed in args.seeds:
                log_dir = os.path.abspath(os.path.join(args.out, run, f"seed{seed}"))
                cmd = command(args.grid, run, seed, log_dir, args.steps, args.nproc, args.overrides)
                ok &= run_one(cmd, log_dir, args.steps)
    table = write_summary(args.out, args.grid, runs, args.seeds, args.threshold)
    print(open(os.path.join(args.out, "summary.md")).read())
    return 0 if ok and all(r["seeds"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
