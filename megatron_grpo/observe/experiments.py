"""Sweeps of training runs and the statistics their pages are made of, shared by ``tools/study/sweep.py``,
``tools/study/writeup.py`` and ``tools/study/writeup_regime.py`` (torch-free; no import outside ``observe/``).

- Running: :func:`train_command` (one ``megatron-grpo train`` process, torchrun for ``nproc`` > 1),
  :func:`run_one` (resumable: a run whose metrics are complete is not redone), :func:`run_pairs`.
- Reading: :func:`read_rows` (a run folder's metrics rows), :func:`summarize_seed` + :func:`write_summary`
  (a sweep's ``summary.md`` / ``summary.csv``), :func:`seed_stats` (one seed's numbers for a page).
- Statistics: :func:`ci95` (95% t-interval over seeds), :func:`fmt_ci`, :func:`paired_diffs`,
  :func:`compare` (paired by seed), :func:`md_table`.
- The write-up's pretrained model (:data:`WRITEUP_RECIPE`, :func:`ensure_pretrained_model`), made by
  ``tools/study/pretrain.py`` in a child process.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from megatron_grpo.observe.metrics_logger import read_metrics_rows

WRITEUP_RECIPE = "recipes/grpo-pretrained-eos-cpu.yaml"
"""The write-up experiments' recipe (relative to the checkout)."""
WRITEUP_MODEL_DIR = os.environ.get("MEGATRON_GRPO_PRETRAINED_DIR", "runs/pretrained/qwen3-4m")
"""The recipe's ``policy.model_name`` (same environment variable, same default)."""
WRITEUP_PRETRAIN_ARGS = ["--size", "4m", "--steps", "1200", "--batch-size", "16", "--seq-len", "128", "--seed", "0"]
"""The write-up's model: ~3.7M params, 2.5M tokens of stdlib source, about 10 minutes on 2 cores."""
SUMMARY_COLUMNS = ["run", "seeds", "final_reward", "best_reward", "steps_to_threshold", "beta_abs_mean",
                   "phantom_fraction_steps_1_5", "phantom_zero_grad_steps_1_5", "phantom_truncated_steps_1_5",
                   "zero_grad_fraction_mean", "deployed_improvement_mean", "kl_rollout_max",
                   "route_mismatch_fraction", "tokens_any_mismatch", "beta_abs_mean_route_mismatch"]
"""The columns of a sweep's ``summary.md`` / ``summary.csv``."""
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student t quantiles (two-sided 95%) by degrees of freedom; 10 and more use 2.2."""
AT_STEPS = (3, 5, 30)
"""Steps at which the phantom / legit fractions are reported (the write-up's)."""
SNR_WINDOWS = ((1, 5), (6, 15), (16, 30))


# ---- running ------------------------------------------------------------------------------------------


CKPT_SUBDIR = "ckpt"
"""A study run's own checkpoints (``log_dir/ckpt``), with ``train_command(..., checkpoint_every_step=True)``."""


def train_command(recipe: str, overrides: Sequence[str], seed: int, log_dir: str, steps: int, nproc: int,
                  extra: Sequence[str] = (), pre: Sequence[str] = (), checkpoint_every_step: bool = False) -> List[str]:
    """One run's command line; ``pre`` overrides go before the run's own (which win), ``extra`` after.
    ``checkpoint_every_step``: the run saves after every step into ``log_dir/ckpt`` (one kept) and resumes from
    it, so a run stopped mid-way (a session's end, a kill) goes on from its last step, not from step 1; resume
    is exact (``tests/test_checkpoint.py``; an async run's generations in flight: ``tests/test_pool.py``), so this
    changes no number."""
    launcher = [sys.executable, "-m", "megatron_grpo"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "megatron_grpo"]
    args = list(pre) + list(overrides) + [f"grpo.seed={seed}", f"logger.log_dir={log_dir}", "logger.progress_bar=false"]
    if checkpoint_every_step:
        args += [f"checkpointing.checkpoint_dir={os.path.join(log_dir, CKPT_SUBDIR)}", "checkpointing.save_period=1",
                 "checkpointing.resume=true", "checkpointing.keep_last_n=1"]
    if steps:
        args.append(f"grpo.max_num_steps={steps}")
    return launcher + ["train", recipe] + args + list(extra)


def run_one(cmd: List[str], log_dir: str, expected_steps: int, cwd: Optional[str] = None) -> bool:
    """Runs one training job unless its metrics are complete; returns True if it is complete. Its output goes
    to ``log_dir/train.log``, its launch-to-exit seconds and exit status to ``log_dir/process.json``."""
    rows = read_rows(log_dir)
    if expected_steps and len(rows) >= expected_steps:
        print(f"[sweep] done already: {log_dir}")
        return True
    os.makedirs(log_dir, exist_ok=True)
    ckpt = os.path.join(log_dir, CKPT_SUBDIR)
    resuming = any(a == f"checkpointing.checkpoint_dir={ckpt}" for a in cmd) and os.path.isdir(ckpt)
    print("[sweep] " + ("(resuming) " if resuming else "") + " ".join(cmd), flush=True)
    started = time.perf_counter()
    with open(os.path.join(log_dir, "train.log"), "a" if resuming else "w") as log:
        code = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT).returncode
    _record_process(log_dir, time.perf_counter() - started, code, resuming)
    if code != 0:
        print(f"[sweep] FAILED ({code}): see {os.path.join(log_dir, 'train.log')}", flush=True)
    elif expected_steps and len(read_rows(log_dir)) >= expected_steps and os.path.isdir(ckpt):
        shutil.rmtree(ckpt)  # finished: the metrics are the run; its resume point is no longer needed
    return code == 0


BF16_ISA = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f")
"""CPU flags that change how bf16 / fp16 GEMMs are computed on CPU (native vs emulated kernels)."""


def cpu_description() -> str:
    """This machine's CPU model and its bf16-relevant ISA flags (``/proc/cpuinfo``), e.g. ``AMD EPYC
    [avx512_bf16 avx512f]``: bf16 runs repeat bit for bit on one machine but not across machines whose bf16
    kernels differ (native ``avx512_bf16`` vs emulated), so each run records the machines it ran on."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if model != "unknown" and flags:
                    break
    except OSError:
        pass
    return f"{model} [{' '.join(f for f in BF16_ISA if f in flags) or 'no avx512 / native bf16'}]"


def _record_process(log_dir: str, wall_s: float, code: int, resuming: bool) -> None:
    """``log_dir/process.json``: launch-to-exit seconds (imports included), exit status and the CPU of each launch
    (``cpu_description``); a resumed run adds its launches' seconds (``launches`` counts them)."""
    path = os.path.join(log_dir, "process.json")
    before = load_state(path) if resuming else {}
    state = {"process_wall_s": before.get("process_wall_s", 0.0) + wall_s, "returncode": code,
             "launches": before.get("launches", 0) + 1, "cpus": before.get("cpus", []) + [cpu_description()]}
    with open(path, "w") as f:
        json.dump(state, f)


def run_pairs(recipe: str, grid: Dict[str, List[str]], out: str, pairs: Iterable[Tuple[str, int]], steps: int,
              nproc: int, extra: Sequence[str], pre: Sequence[str] = (), cwd: Optional[str] = None) -> bool:
    """Runs (run, seed) pairs of ``grid`` in order into ``out/run/seedK``, each resumable; True if all completed."""
    ok = True
    for run, seed in pairs:
        log_dir = os.path.abspath(os.path.join(out, run, f"seed{seed}"))
        ok &= run_one(train_command(recipe, grid[run], seed, log_dir, steps, nproc, extra, pre), log_dir, steps, cwd)
    return ok


def ensure_pretrained_model(root: str, model_dir: str = WRITEUP_MODEL_DIR,
                            pretrain_args: Sequence[str] = tuple(WRITEUP_PRETRAIN_ARGS)) -> str:
    """Pretrains the write-up's model with ``root/tools/study/pretrain.py`` unless ``model_dir/config.json`` exists,
    then writes its EOS-task prompts unless they exist (``model_dir`` relative to ``root``, the checkout)."""
    path = os.path.join(root, model_dir)
    tool = os.path.join(root, "tools", "study", "pretrain.py")
    steps = []
    if not os.path.isfile(os.path.join(path, "config.json")):
        steps.append([sys.executable, tool, "--out", path] + list(pretrain_args))
    if steps or not os.path.isfile(os.path.join(path, "eos_prompts.jsonl")):
        steps.append([sys.executable, tool, "--out", path, "--eos-prompts"])
    for cmd in steps:
        print("[writeup] " + " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=root, check=True)
    return path


# ---- reading ------------------------------------------------------------------------------------------


def load_state(path: str) -> Dict:
    """A study's JSON state file (``{}`` before its first stage)."""
    return json.load(open(path)) if os.path.isfile(path) else {}


def save_state(path: str, **update) -> Dict:
    """Merges ``update`` into the JSON state file at ``path``; returns the new state."""
    state = {**load_state(path), **update}
    with open(path, "w") as f:
        json.dump(state, f, indent=2)
    return state



def read_rows(log_dir: str) -> List[dict]:
    """The metrics rows of one run folder ([] if it has none yet)."""
    path = os.path.join(log_dir, "metrics.jsonl")
    return read_metrics_rows(path) if os.path.isfile(path) else []


def _series(rows, key):
    return [r[key] for r in rows if r.get(key) is not None]


def _nan_mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize_seed(rows: List[dict], threshold: float) -> Dict[str, float]:
    """A sweep table's numbers for one seed's metrics rows."""
    rewards = _series(rows, "reward/mean")
    reach = [r["step"] for r in rows if r.get("reward/mean") is not None and r["reward/mean"] >= threshold]
    early = [r for r in rows if r["step"] <= 5]
    return {
        "final_reward": rewards[-1] if rewards else float("nan"),
        "best_reward": max(rewards) if rewards else float("nan"),
        "steps_to_threshold": float(reach[0]) if reach else float("nan"),
        "beta_abs_mean": _nan_mean(_series(rows, "precision/beta_abs_mean")),
        "phantom_fraction_steps_1_5": _nan_mean(_series(early, "clip/phantom_region_fraction")),
        "phantom_zero_grad_steps_1_5": _nan_mean(_series(early, "clip/phantom_zero_grad_fraction")),
        "phantom_truncated_steps_1_5": _nan_mean(_series(early, "clip/phantom_truncated_fraction")),
        "zero_grad_fraction_mean": _nan_mean(_series(rows, "clip/zero_grad_fraction")),
        "deployed_improvement_mean": _nan_mean(_series(rows, "policy/deployed_improvement")),
        "kl_rollout_max": max(_series(rows, "policy/kl_rollout"), default=float("nan")),
        "route_mismatch_fraction": _nan_mean(_series(rows, "moe/route_mismatch_fraction")),
        "tokens_any_mismatch": _nan_mean(_series(rows, "moe/tokens_any_mismatch")),
        "beta_abs_mean_route_mismatch": _nan_mean(_series(rows, "precision/beta_abs_mean_route_mismatch")),
    }


def _fmt_std(values: List[float]) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "n/a"
    if len(finite) == 1:
        return f"{finite[0]:.4g}"
    return f"{statistics.mean(finite):.4g} ± {statistics.stdev(finite):.2g}"


def write_summary(out: str, grid: str, runs: Sequence[str], seeds: Sequence[int], threshold: float) -> List[dict]:
    """``out/summary.csv`` and ``out/summary.md``: one row per run, mean ± std over the seeds with metrics."""
    table = []
    for run in runs:
        per_seed = [summarize_seed(read_rows(os.path.join(out, run, f"seed{s}")), threshold) for s in seeds]
        per_seed = [p for p in per_seed if not math.isnan(p["final_reward"])]
        row = {"run": run, "seeds": len(per_seed)}
        row.update({k: _fmt_std([p[k] for p in per_seed]) for k in SUMMARY_COLUMNS[2:]})
        table.append(row)
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(f"# Sweep `{grid}` (mean ± std over seeds; reward threshold {threshold})\n\n")
        f.write("| " + " | ".join(SUMMARY_COLUMNS) + " |\n|" + "---|" * len(SUMMARY_COLUMNS) + "\n")
        for row in table:
            f.write("| " + " | ".join(str(row[c]) for c in SUMMARY_COLUMNS) + " |\n")
    return table


def final_reward(rows: List[dict], last: int = 5) -> float:
    """Mean of ``reward/mean`` over the last ``last`` logged steps (one step's reward is noisy)."""
    return _nan_mean(_series(rows, "reward/mean")[-last:])


def at_step(rows: List[dict], key: str, step: int) -> float:
    vals = [r[key] for r in rows if r.get("step") == step and r.get(key) is not None]
    return vals[0] if vals else float("nan")


def mean_key(rows: List[dict], key: str, lo: int = 1, hi: int = 10 ** 9) -> float:
    """Mean of ``key`` over steps ``lo..hi`` (nan when none logged it)."""
    return _nan_mean([r[key] for r in rows if lo <= r.get("step", 0) <= hi and r.get(key) is not None])


def seed_stats(rows: List[dict], threshold: float, last: int = 5) -> Dict[str, float]:
    """One seed's numbers for a page, from its metrics rows (final reward: the last ``last`` steps)."""
    reach = [r["step"] for r in rows if r.get("reward/mean") is not None and r["reward/mean"] >= threshold]
    out = {"final_reward": final_reward(rows, last), "reward_step1": at_step(rows, "reward/mean", 1),
           "steps_to_threshold": float(reach[0]) if reach else float("nan"),
           "reached": 1.0 if reach else 0.0,
           "deployed_improvement": mean_key(rows, "policy/deployed_improvement"),
           "beta_abs_mean": mean_key(rows, "precision/beta_abs_mean"),
           "kl_rollout_max": max(_series(rows, "policy/kl_rollout"), default=float("nan")),
           "kl_ref_max": max(_series(rows, "policy/kl_ref"), default=float("nan")),
           "cos_clean": mean_key(rows, "grad/cos_clean"),
           "zero_grad_1_5": mean_key(rows, "clip/phantom_zero_grad_fraction", 1, 5)}
    for bucket in ("common", "medium", "rare"):
        out[f"beta_{bucket}"] = mean_key(rows, f"precision/beta_abs_mean_{bucket}")
    for step in AT_STEPS:
        for kind in ("phantom", "legit"):
            out[f"{kind}_region@{step}"] = at_step(rows, f"clip/{kind}_region_fraction", step)
        out[f"phantom_zero_grad@{step}"] = at_step(rows, "clip/phantom_zero_grad_fraction", step)
    for lo, hi in SNR_WINDOWS:
        out[f"snr_{lo}_{hi}"] = mean_key(rows, "precision/snr", lo, hi)
    return out


def model_card_lines(path: str) -> List[str]:
    """The non-empty lines of ``path/MODEL_CARD.md`` after its title (``tools/study/pretrain.py`` writes it)."""
    card = os.path.join(path, "MODEL_CARD.md")
    if not os.path.isfile(card):
        return [f"(no model card at {path})"]
    return [line for line in open(card).read().splitlines()[2:] if line.strip()]


# ---- statistics ---------------------------------------------------------------------------------------


def ci95(values: Sequence[float]) -> tuple:
    """(mean, half-width of the 95% t interval, n) over the finite values; half-width nan for n < 2."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return float("nan"), float("nan"), 0
    if len(xs) == 1:
        return xs[0], float("nan"), 1
    return statistics.mean(xs), T975.get(len(xs) - 1, 2.2) * statistics.stdev(xs) / math.sqrt(len(xs)), len(xs)


def fmt_ci(values: Sequence[float], digits: int = 3) -> str:
    mean, half, n = ci95(values)
    if n == 0:
        return "n/a"
    return f"{mean:.{digits}g}" if math.isnan(half) else f"{mean:.{digits}g} ± {half:.2g}"


def md_table(header: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def paired_diffs(x: List[Dict], y: List[Dict], key: str = "final_reward") -> List[float]:
    """``x[key] - y[key]`` for every seed both have, in ``x``'s order."""
    ys = {s["seed"]: s[key] for s in y}
    return [s[key] - ys[s["seed"]] for s in x if s["seed"] in ys]


def decide(diffs: Sequence[float], d: float, min_effect: Optional[float] = None) -> Tuple[str, float, float, int]:
    """The studies' pre-registered rule on per-seed differences (a fix minus the failing arm): (word, mean,
    half-width, n), with the 95% t-interval of the mean difference and an equivalence margin ``d``.

    reproduced: the interval excludes 0 on the positive side and the mean is >= ``min_effect`` (default ``d``);
    not reproduced: the interval lies inside [-d, d], or wholly below 0 (the opposite direction);
    inconclusive: anything else (too wide, a real effect below ``min_effect`` reaching past d, < 2 seeds)."""
    min_effect = d if min_effect is None else min_effect
    mean, half, n = ci95(diffs)
    if n < 2 or math.isnan(half):
        return "inconclusive", mean, half, n
    lo, hi = mean - half, mean + half
    if lo > 0 and mean >= min_effect:
        return "reproduced", mean, half, n
    if (-d <= lo and hi <= d) or hi < 0:
        return "not reproduced", mean, half, n
    return "inconclusive", mean, half, n


def compare(x: List[Dict], y: List[Dict], key: str = "final_reward") -> str:
    """``x`` vs ``y`` on ``key``, paired by seed (runs of one seed share prompts and their first rollouts):
    'higher' / 'lower' when the 95% t-interval of the mean per-seed difference excludes 0, else
    'indistinguishable'; the difference and its interval follow in parentheses."""
    mean, half, n = ci95(paired_diffs(x, y, key))
    if n < 2:
        return f"indistinguishable (difference {mean:.3g}, {n} seed: no interval)" if n else "n/a (no common seed)"
    word = "higher" if mean - half > 0 else "lower" if mean + half < 0 else "indistinguishable"
    return f"{word} (difference {mean:.3g} ± {half:.2g}, {n} paired seeds)"
