"""Body of ``tools/cluster/gpu_check.sh``: the one-H200 check, in named phases, through the real trainer.

    python tools/cluster/gpu_check.py --out OUT [--dry] [--work DIR] [--budget SECONDS] [--phases a,b,...]
    python tools/cluster/gpu_check.py preflight --json PATH --work DIR --out DIR [--dry]      # the child processes
    python tools/cluster/gpu_check.py beta|fp8 --json PATH --model DIR [--seqs N] [--seq-len N] [--block N]

Phases, in this order (``--phases`` picks a subset; ``preflight`` always runs first):

- ``preflight``: python / torch / CUDA versions, device name and memory, free disk (work dir, OUT,
  /dev/shm), the wheels ``gpu_check.sh`` installed, imports of megatron.core / omegaconf / yaml /
  safetensors / megatron_grpo, Transformer Engine and vLLM present or not. Any problem fails it, and
  every later phase is then skipped: the reason is the first thing in the JSON.
- ``smoke``: one step of ``python -m megatron_grpo train`` (recipe A: bf16 autocast) on a tiny
  Qwen3 model on the device: forward, backward and optimizer step of the real trainer, in seconds.
- ``beta``: the fp32-vs-bf16 and fp32-vs-fp16 log-prob gaps of the Qwen3-0.6B-shaped model by
  rarity bucket (the trainer's forward), plus each precision's own error against an fp64 forward
  of the same weights (|lp_fp32 - lp_fp64| ~1e-6, |lp_bf16 - lp_fp64| ~1e-2).
- ``fp8``: the FP8 kernel residual (``megatron_grpo.models.fp8_kernels``): our emulated FP8 GEMM (the FP8 shadow's
  and the megatron generator's) against a real FP8 GEMM on the same e4m3 bytes and scales (``torch._scaled_mm``,
  block-scaled per 128-wide K slice as DeepGEMM / CUTLASS do) on every FP8 linear of the model (its captured bf16
  inputs) and through its log-probs, beside the FP8 gap itself (emulated FP8 vs bf16); [128, 128] blocks
  (32 in the dry run). The device has no vLLM: this is the kernels' share of a vLLM-vs-shadow gap.
- ``A``, ``shadow``, ``fp16``, ``B``: ``python -m megatron_grpo train`` (the real loop, ``generation.backend=
  megatron``: the trainer's own model generates, no vLLM) with recipes/grpo-qwen3-0.6b-eos-A.yaml (bf16
  autocast trainer + bf16 generator: no shadow forward, beta = 0 exactly), the same with a forced fp16
  shadow (``policy.precision.shadow_dtype=float16``, 2 steps: fp32 params, bf16 compute, fp16 shadow:
  beta finite and > 0, the shadow forward measured), -fp16.yaml (fp16 trainer + fp16 generator with dynamic loss
  scaling: beta = 0 exactly) and -B.yaml (fp32 trainer vs bf16 generator: beta > 0, the write-up's
  mismatch). fp16 runs before B: the last phase is the first one skipped when time runs short.

The model is a random-init checkpoint of the Qwen3-0.6B shape written with torch + safetensors alone
(``megatron_grpo.models.random_checkpoint``: no transformers, no tokenizer: token-id prompts). The
preflight and beta measurements run in child processes (``python tools/cluster/gpu_check.py preflight|beta ...``);
the phase runner (budget, atomic JSON, child processes) is ``megatron_grpo.observe.phases``.

``OUT/gpu_check.json`` is rewritten atomically (temp file in OUT, fsync, ``os.replace``) before and
after each phase: each phase's status (``ok`` / ``failed`` + reason / ``skipped`` + why /
``not_run``), measurements and seconds, ``running`` (the phase in flight), and ``not_measured``
(every quantity this check did not measure, and why). A killed run (timeout, crash) thus leaves a
valid JSON of the phases done so far. A phase whose estimate does not fit the remaining
``--budget`` is skipped, not started. Exit 0 only when every phase that ran is ok.
``--dry`` (``GPU_CHECK_DRY=1``): the same phases on CPU with the tiny model and 2 steps per run,
so CI runs this script (tests/test_tools.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo
for _path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)
from megatron_grpo.models.random_checkpoint import STOP_EVERY, write_random_qwen3  # noqa: E402
from megatron_grpo.observe.machine import device_info, disk_info, import_probe, optional_probe  # noqa: E402
from megatron_grpo.observe.phases import Child, PhaseFailed, PhaseSpec, run_phases  # noqa: E402
from megatron_grpo.observe.phases import phase_line as _phase_line  # noqa: E402
from gpu_check_report import fp8_errors, report_beta, report_fp8, report_run  # noqa: E402  (tools/ sibling)

QWEN3_0_6B_CONFIG = os.path.join(ROOT, "recipes", "model_configs", "qwen3-0.6b", "config.json")
DRY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, eos_token_id=511,
                 bos_token_id=510)
"""The tiny model (smoke; every phase with --dry): the Qwen3-0.6B config with these keys replaced
(~0.13M params: emulated bf16 on CPU is slow); heads x head_dim = 2 x hidden, as in Qwen3-0.6B."""
PHASES = ("preflight", "smoke", "beta", "fp8", "A", "shadow", "fp16", "B")
"""fp16 (the only loss-scaling run) before B: the last phase is the first one skipped when time runs short."""
RUNS = {"A": "recipes/grpo-qwen3-0.6b-eos-A.yaml", "shadow": "recipes/grpo-qwen3-0.6b-eos-A.yaml",
        "fp16": "recipes/grpo-qwen3-0.6b-eos-fp16.yaml", "B": "recipes/grpo-qwen3-0.6b-eos-B.yaml"}
RUN_OVERRIDES = {"shadow": ["policy.precision.shadow_dtype=float16"]}
"""shadow: run A (fp32 params, bf16 compute and generator) with a forced fp16 shadow forward."""
RUN_STEPS = {"shadow": 2}
"""Steps of a run when fewer than RUN_SIZE's (beta is measured on every step: 2 show it, and leave time for B)."""
BETA_ZERO_RUNS = ("A", "fp16")
"""Precision-matched runs (trainer compute dtype = generator dtype, no shadow forward): beta exactly 0."""
BETA_POSITIVE_RUNS = ("shadow", "B")
"""Runs whose shadow forward differs from the trainer's: beta finite on every step, > 0 on average."""
RUN_SIZE = {  # steps, prompts per step, generations per prompt, max new tokens; beta: sequences x length
    # gpu: the megatron engine draws each row's sampling noise on the host (vocab 151936 per row and
    # token), so generation dominates; 8 x 8 rollouts of <= 48 tokens keep A, B and fp16 inside the limit.
    "gpu": dict(steps=4, prompts=8, generations=8, max_new_tokens=48, beta_seqs=16, beta_len=256, fp8_block=128),
    "dry": dict(steps=2, prompts=2, generations=4, max_new_tokens=8, beta_seqs=4, beta_len=32, fp8_block=32),
}
SMOKE_SIZE = dict(steps=1, prompts=2, generations=4, max_new_tokens=8)
ESTIMATE_S = {
    # What a phase is expected to take: it is skipped when this does not fit the remaining budget. After
    # a training run, the later runs are estimated at least at its measured time.
    "gpu": dict(preflight=20, smoke=45, beta=75, fp8=45, A=100, shadow=60, fp16=100, B=100),
    "dry": dict(preflight=30, smoke=50, beta=50, fp8=50, A=65, shadow=65, fp16=75, B=65),  # a loaded 2-core CI box
}
MEASURES = {
    "preflight": "versions, device, free disk, installed wheels, imports",
    "smoke": "one bf16 train step (forward, backward, optimizer) of a tiny model on the device",
    "beta": "fp32-vs-bf16/fp16 log-prob gaps and each precision's error vs fp64, by rarity bucket",
    "fp8": "the FP8 kernel residual: our emulated FP8 GEMM vs a real one (torch._scaled_mm) per linear and in "
           "log-probs, beside the FP8 gap",
    "A": "run A: bf16 trainer + bf16 generator (beta must be 0), phantom clipping, step times",
    "shadow": "run A with a forced fp16 shadow (fp32 params, bf16 compute): beta finite and > 0, step times",
    "fp16": "run fp16: fp16 trainer + fp16 generator (beta must be 0), loss scaling, step times",
    "B": "run B: fp32 trainer vs bf16 generator (beta > 0), phantom clipping, step times",
}
FP32_VS_FP64_MAX = 1e-4
"""beta phase: mean |lp_fp32 - lp_fp64| above this means the fp32 path is not true fp32 (TF32 on?)."""
METRICS = ("precision/beta_abs_mean", "precision/beta_abs_max", "precision/beta_abs_mean_common",
           "precision/beta_abs_mean_medium", "precision/beta_abs_mean_rare", "precision/alpha_abs_mean",
           "clip/region_fraction", "clip/phantom_region_fraction", "clip/legit_region_fraction",
           "clip/zero_grad_fraction", "clip/phantom_zero_grad_fraction", "clip/legit_zero_grad_fraction",
           "loss/policy", "train/grad_norm", "train/loss_scale", "train/skipped_overflow",
           "reward/mean", "completion/length_mean", "time/step_s", "timing/generate_s", "timing/train_s")


IMPORTS = ("megatron.core", "omegaconf", "yaml", "safetensors", "megatron_grpo")
"""What preflight imports: the train path's needs beyond torch (gpu_check.sh installs them from ./wheels)."""
MIN_FREE_GIB = {"gpu": 3.0, "dry": 0.2}
"""Free disk the work dir needs (the bf16 0.6B checkpoint is 1.2 GB)."""
TAG = "gpu_check"
UNSELECTED = "not in --phases (GPU_CHECK_PHASES)"
phase_line = functools.partial(_phase_line, tag=TAG)


# ---- the measurements the child processes run --------------------------------------------------------


def model_config(overrides: Optional[Dict] = None) -> Dict:
    """The Qwen3-0.6B config.json with ``overrides``."""
    with open(QWEN3_0_6B_CONFIG) as f:
        return dict(json.load(f), **(overrides or {}), torch_dtype="bfloat16")


def preflight_info(work: str, out: str, dry: bool) -> Dict:
    """Everything the later phases rely on; ``problems`` lists what makes them pointless."""
    mode = "dry" if dry else "gpu"
    info: Dict = {"python": sys.version.split()[0], "executable": sys.executable, "problems": [],
                  "wheels_installed": os.environ.get("GPU_CHECK_INSTALLED", "").split()}
    try:
        info.update(device_info())
    except Exception as exc:  # noqa: BLE001
        info["problems"].append(f"torch is not usable by {sys.executable}: {type(exc).__name__}: {exc}")
        return info
    if not dry and not info["cuda_available"]:
        info["problems"].append(f"no CUDA device visible to torch {info['torch']} (built for CUDA "
                                f"{info['torch_cuda']}); GPU_CHECK_DRY=1 runs the CPU dry run")
    info.update(disk_info({"work": work, "out": out, "dev_shm": "/dev/shm"}))
    if (info["work_free_gib"] or 0.0) < MIN_FREE_GIB[mode]:
        info["problems"].append(f"only {info['work_free_gib']:.2f} GiB free in the work dir {work} "
                                f"(needs {MIN_FREE_GIB[mode]} GiB; set GPU_CHECK_WORK)")
    info["imports"] = {m: import_probe(m) for m in IMPORTS}
    for module, probe in info["imports"].items():
        if not probe["ok"]:
            info["problems"].append(f"import {module} failed: {probe['error']} (installed from ./wheels: "
                                    f"{', '.join(info['wheels_installed']) or 'none'})")
    info["transformer_engine"] = optional_probe("transformer_engine", "transformer_engine.pytorch",
                                                info["cuda_available"])
    info["vllm"] = optional_probe("vllm", "vllm", info["cuda_available"])
    return info


def child_main(argv: List[str]) -> int:
    """``preflight ...`` / ``beta ...``: the measurements the phases run in child processes (JSON to --json)."""
    parser = argparse.ArgumentParser(prog=f"gpu_check.py {argv[0]}")
    parser.add_argument("--json", required=True)
    if argv[0] == "preflight":
        parser.add_argument("--work", required=True)
        parser.add_argument("--out", required=True)
        parser.add_argument("--dry", action="store_true")
        args = parser.parse_args(argv[1:])
        result = preflight_info(args.work, args.out, args.dry)
    else:
        parser.add_argument("--model", required=True)
        parser.add_argument("--seqs", type=int, default=16)
        parser.add_argument("--seq-len", type=int, default=256)
        parser.add_argument("--block", type=int, default=128, help="fp8: weight block side and activation group")
        args = parser.parse_args(argv[1:])
        result = measure_child(argv[0], args)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def measure_child(name: str, args) -> Dict:
    """beta / fp8: the measurement itself, in the child (its imports: megatron.core)."""
    if name == "fp8":
        from megatron_grpo.models.fp8 import Fp8Recipe
        from megatron_grpo.models.fp8_kernels import measure_fp8_kernel_residual

        return measure_fp8_kernel_residual(args.model, args.seqs, args.seq_len,
                                           Fp8Recipe((args.block, args.block), args.block))
    from megatron_grpo.loss.metrics import COMMON_LOGPROB, RARE_LOGPROB
    from megatron_grpo.models.precision_gaps import measure_precision_gaps

    return measure_precision_gaps(args.model, args.seqs, args.seq_len, COMMON_LOGPROB, RARE_LOGPROB)


# ---- the phases ----------------------------------------------------------------------------------------


class Context:
    """What the phases share: folders, mode, the child environment, the checkpoints (written on first use)."""

    def __init__(self, out: str, work: str, dry: bool):
        self.out, self.work, self.dry = out, work, dry
        self.mode = "dry" if dry else "gpu"
        self.size = RUN_SIZE[self.mode]
        path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        PYTHONPATH=os.pathsep.join(path))
        if dry:
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path, also on a GPU machine
        self.models: Dict[str, Dict] = {}

    def model_dir(self, tiny: bool) -> str:
        """The tiny checkpoint (smoke, and everything with --dry) or the Qwen3-0.6B-shaped one."""
        tiny = tiny or self.dry
        name = "qwen3-tiny-random" if tiny else "qwen3-0.6b-random"
        path = os.path.join(self.work, name)
        if name not in self.models:
            start = time.perf_counter()
            write_random_qwen3(path, model_config(DRY_SHAPE if tiny else None))
            self.models[name] = {"dir": path, "write_s": time.perf_counter() - start}
            print(f"gpu_check: wrote {path} in {self.models[name]['write_s']:.1f} s", flush=True)
        return path

    def child(self, name: str, cmd: List[str], timeout_s: float) -> Child:
        child = Child(name, cmd, os.path.join(self.work, f"{name}.log"), self.env, timeout_s, cwd=ROOT, tag=TAG)
        child.run()
        child.check()
        return child

    def measure(self, sub: str, *args: str) -> List[str]:
        """The command line of a measurement child: this script with ``sub`` (preflight / beta)."""
        return [sys.executable, os.path.abspath(__file__), sub, *args]


def phase_preflight(ctx: Context, timeout_s: float) -> Dict:
    path = os.path.join(ctx.work, "preflight.json")
    ctx.child("preflight", ctx.measure("preflight", "--json", path, "--work", ctx.work, "--out", ctx.out,
                                    *(["--dry"] if ctx.dry else [])), timeout_s)
    with open(path) as f:
        info = json.load(f)
    if info["problems"]:
        raise PhaseFailed("; ".join(info["problems"]), info)
    return info


def phase_beta(ctx: Context, timeout_s: float) -> Dict:
    path = os.path.join(ctx.work, "beta.json")
    model = ctx.model_dir(tiny=False)
    ctx.child("beta", ctx.measure("beta", "--model", model, "--json", path, "--seqs", str(ctx.size["beta_seqs"]),
                               "--seq-len", str(ctx.size["beta_len"])), timeout_s)
    with open(path) as f:
        beta = json.load(f)
    errors = beta_errors(beta)
    if errors:
        raise PhaseFailed("; ".join(errors), beta)
    return beta


def phase_fp8(ctx: Context, timeout_s: float) -> Dict:
    path, block = os.path.join(ctx.work, "fp8.json"), str(ctx.size["fp8_block"])
    ctx.child("fp8", ctx.measure("fp8", "--model", ctx.model_dir(tiny=False), "--json", path, "--block", block,
                              "--seqs", str(ctx.size["beta_seqs"]), "--seq-len", str(ctx.size["beta_len"])), timeout_s)
    with open(path) as f:
        fp8 = json.load(f)
    errors = fp8_errors(fp8)
    if errors:
        raise PhaseFailed("; ".join(errors), fp8)
    return fp8


def beta_errors(beta: Dict) -> List[str]:
    """fp32 must sit near fp64, the low precisions further away; every gap finite and > 0."""
    errors = []
    for key in ("beta_bf16_abs_mean", "beta_fp16_abs_mean", "err_vs_fp64_fp32_abs_mean",
                "err_vs_fp64_bf16_abs_mean", "err_vs_fp64_fp16_abs_mean"):
        value = beta.get(key)
        if not (isinstance(value, float) and math.isfinite(value) and value > 0):
            errors.append(f"beta: {key} should be finite and > 0, got {value}")
    if errors:
        return errors
    fp32 = beta["err_vs_fp64_fp32_abs_mean"]
    if fp32 > FP32_VS_FP64_MAX:
        errors.append(f"beta: mean |lp_fp32 - lp_fp64| = {fp32:.2e} > {FP32_VS_FP64_MAX:.0e}: the fp32 forward is "
                      "not true fp32 (TF32 on?)")
    for low in ("bf16", "fp16"):
        if not beta[f"err_vs_fp64_{low}_abs_mean"] > fp32:
            errors.append(f"beta: {low}'s error vs fp64 ({beta[f'err_vs_fp64_{low}_abs_mean']:.2e}) should exceed "
                          f"fp32's ({fp32:.2e})")
    return errors


def run_overrides(model_dir: str, log_dir: str, size: Dict) -> List[str]:
    return [f"policy.model_name={model_dir}", "generation.backend=megatron", f"grpo.max_num_steps={size['steps']}",
            f"grpo.num_prompts_per_step={size['prompts']}", f"grpo.num_generations_per_prompt={size['generations']}",
            f"generation.max_new_tokens={size['max_new_tokens']}", f"logger.log_dir={log_dir}",
            "logger.tensorboard=false", "logger.progress_bar=false", "checkpointing.checkpoint_dir=null"]


def train_run(ctx: Context, name: str, recipe: str, model_dir: str, size: Dict, timeout_s: float) -> Dict:
    """``python -m megatron_grpo train RECIPE`` (+ ``RUN_OVERRIDES[name]``) for ``size['steps']`` steps; its
    metrics summary (the metrics file is copied to OUT/run_NAME.metrics.jsonl, also when the run failed)."""
    log_dir = os.path.join(ctx.work, f"run_{name}")
    shutil.rmtree(log_dir, ignore_errors=True)
    metrics = os.path.join(log_dir, "metrics.jsonl")
    cmd = [sys.executable, "-m", "megatron_grpo", "train", recipe] + run_overrides(model_dir, log_dir, size)
    cmd += RUN_OVERRIDES.get(name, [])
    label = " ".join([recipe] + RUN_OVERRIDES.get(name, []))
    try:
        ctx.child(f"run_{name}", cmd, timeout_s)
    except PhaseFailed as exc:
        exc.measurements = dict(summarize_run(metrics, size["steps"]), recipe=label)
        raise
    finally:
        if os.path.isfile(metrics):
            shutil.copyfile(metrics, os.path.join(ctx.out, f"run_{name}.metrics.jsonl"))
    return dict(summarize_run(metrics, size["steps"]), recipe=label)


def summarize_run(metrics_path: str, steps: int) -> Dict:
    """Per-step series of METRICS plus means; the step time mean leaves out step 1 (warm-up)."""
    from megatron_grpo.observe.metrics_logger import read_metrics_rows

    rows = read_metrics_rows(metrics_path) if os.path.isfile(metrics_path) else []
    out: Dict = {"steps_logged": len(rows), "steps_planned": steps}
    for key in METRICS:
        values = [r.get(key) for r in rows]
        out[key] = values
        finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        out[f"{key}:mean"] = sum(finite) / len(finite) if finite else None
    times = [t for t in out["time/step_s"][1:] if isinstance(t, (int, float))]
    out["step_s_mean_after_first"] = sum(times) / len(times) if times else None
    return out


def _finite(values: Sequence) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def run_errors(name: str, run: Dict) -> List[str]:
    """The contract of a training run: every step logged with a finite step time > 0 and a finite loss;
    A / fp16 (precision-matched): beta exactly 0 on every step; shadow / B: beta finite on every step and
    its mean > 0 (the shadow forward ran and differs from the trainer's)."""
    if run["steps_logged"] != run["steps_planned"]:
        return [f"{name}: {run['steps_logged']} of {run['steps_planned']} steps in metrics.jsonl"]
    errors = []
    if not (_finite(run["time/step_s"]) and all(t > 0 for t in run["time/step_s"])):
        errors.append(f"{name}: step times not all finite and > 0: {run['time/step_s']}")
    if not _finite(run["loss/policy"]):
        errors.append(f"{name}: loss/policy not finite: {run['loss/policy']}")
    beta = run["precision/beta_abs_mean"] + run["precision/beta_abs_max"]
    if name in BETA_ZERO_RUNS and any(v != 0.0 for v in beta):
        errors.append(f"{name} (precision-matched) must have beta exactly 0 on every step, got beta_abs_mean "
                      f"{run['precision/beta_abs_mean']}, max {run['precision/beta_abs_max']}")
    if name in BETA_POSITIVE_RUNS and not (_finite(beta) and (run["precision/beta_abs_mean:mean"] or 0.0) > 0.0):
        errors.append(f"{name} (the shadow forward differs from the trainer's) must have beta finite and > 0, got "
                      f"beta_abs_mean {run['precision/beta_abs_mean']}, max {run['precision/beta_abs_max']}")
    return errors


def phase_smoke(ctx: Context, timeout_s: float) -> Dict:
    run = train_run(ctx, "smoke", RUNS["A"], ctx.model_dir(tiny=True), SMOKE_SIZE, timeout_s)
    errors = run_errors("smoke", run)
    if not errors and not _finite(run["train/grad_norm"]):
        errors.append(f"smoke: train/grad_norm not finite: {run['train/grad_norm']}")
    if errors:
        raise PhaseFailed("; ".join(errors), run)
    return run


def phase_run(name: str) -> Callable[[Context, float], Dict]:
    def run_phase(ctx: Context, timeout_s: float) -> Dict:
        size = dict(ctx.size, steps=min(ctx.size["steps"], RUN_STEPS.get(name, ctx.size["steps"])))
        run = train_run(ctx, name, RUNS[name], ctx.model_dir(tiny=False), size, timeout_s)
        errors = run_errors(name, run)
        if errors:
            raise PhaseFailed("; ".join(errors), run)
        return run

    return run_phase


def parse_phases(text: Optional[str]) -> List[str]:
    """``--phases a,b``: the selected phases in PHASES order; empty = all; preflight always."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        raise ValueError(f"--phases (GPU_CHECK_PHASES): unknown phase(s) {', '.join(unknown)}; valid: "
                         f"{','.join(PHASES)}")
    return [p for p in PHASES if not names or p in names or p == "preflight"]


# ---- reporting -----------------------------------------------------------------------------------------


def report(results: Dict) -> str:
    pre = results["phases"]["preflight"].get("measurements") or {}
    lines = [f"== gpu_check ({results['mode']}) on {pre.get('device', '?')} (torch {pre.get('torch', '?')}, CUDA "
             f"{pre.get('torch_cuda') or '-'}): model {results['model']['shape']}, wall {results['wall_s']:.0f} s of "
             f"{results['budget_s']:.0f} =="]
    for name, rec in results["phases"].items():
        m = rec.get("measurements") or {}
        if name == "beta" and "err_vs_fp64_fp32_abs_mean" in m:
            lines += report_beta(m)
        elif name == "fp8" and "lp_residual_abs_mean" in m:
            lines += report_fp8(m)
        elif name in ("smoke",) + tuple(RUNS) and m.get("steps_logged"):
            lines += report_run(name, m)
    lines += [phase_line(name, rec) for name, rec in results["phases"].items()]
    lines += ["not measured:"] + [f"  - {n}" for n in results["not_measured"]]
    return "\n".join(lines)


def machine_notes(mode: str) -> Callable[[Dict], List[str]]:
    """What this machine / this check does not measure, from preflight's findings."""

    def notes(results: Dict) -> List[str]:
        pre = results["phases"]["preflight"].get("measurements") or {}
        te, vllm = pre.get("transformer_engine"), pre.get("vllm")
        out = []
        if mode == "dry":
            out.append("GPU kernels and memory: dry run on CPU (bf16/fp16 emulated, tiny model)")
        if vllm is None:
            out.append("vLLM generation: unknown whether installed (preflight did not finish); runs use "
                       "generation.backend=megatron")
        elif not vllm["installed"]:
            out.append("vLLM generation: vLLM is not installed on the device (runs use generation.backend=megatron)")
        else:
            out.append("vLLM generation: not exercised (runs use generation.backend=megatron)")
        out.append("vLLM's FP8 kernels (DeepGEMM / CUTLASS block FP8): not on the device; the fp8 phase measures our "
                   "emulated FP8 GEMM against torch._scaled_mm on the same bytes")
        if te is None or not te["usable"]:
            out.append(f"Transformer Engine GEMMs: {'unknown' if te is None else te['why']} (Megatron's local "
                       "spec with torch autocast)")
        out.append("multi-GPU parallelism (TP/PP/EP/DP > 1) and checkpoint save/resume: one device, "
                   "checkpointing.checkpoint_dir=null")
        return out

    return notes


def build_specs(ctx: Context) -> List[PhaseSpec]:
    funcs = {"preflight": phase_preflight, "smoke": phase_smoke, "beta": phase_beta, "fp8": phase_fp8,
             **{name: phase_run(name) for name in RUNS}}
    return [PhaseSpec(name, functools.partial(funcs[name], ctx), ESTIMATE_S[ctx.mode][name], MEASURES[name],
                      group="run" if name in RUNS else "") for name in PHASES]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results folder (small files only)")
    parser.add_argument("--work", default=None, help="checkpoints + run folders, kept out of OUT (default: a new "
                                                     "temporary folder)")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny model, 2 steps (CI)")
    parser.add_argument("--budget", type=float, default=470.0, help="seconds for all phases together")
    parser.add_argument("--phases", default=os.environ.get("GPU_CHECK_PHASES", ""),
                        help=f"comma-separated subset of {','.join(PHASES)} (default: all; preflight always runs)")
    args = parser.parse_args(argv)
    try:
        selected = parse_phases(args.phases)
    except ValueError as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still records the phase in flight
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
    os.makedirs(out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    ctx = Context(out, work, args.dry)
    shape_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "tie_word_embeddings")
    cfg = model_config(DRY_SHAPE if args.dry else None)
    header = {"mode": ctx.mode, "size": ctx.size, "smoke_size": SMOKE_SIZE, "work": work,
              "model": {"shape": {k: cfg[k] for k in shape_keys}, "models": ctx.models,
                        "stop_token_ids": f"eos {cfg['eos_token_id']} + every {STOP_EVERY}th id"}}
    json_path = os.path.join(out, "gpu_check.json")
    results = run_phases(build_specs(ctx), selected, args.budget, json_path, header, machine_notes(ctx.mode),
                         tag=TAG, unselected=UNSELECTED)
    print(report(results), flush=True)
    print(f"gpu_check: results in {json_path}", flush=True)
    failed = [phase_line(n, r) for n, r in results["phases"].items() if r["status"] == "failed"]
    if not results["ok"]:
        failed = failed or [phase_line("preflight", results["phases"]["preflight"])]  # nothing was checked
        print("gpu_check: FAILED:\n  " + "\n  ".join(failed), flush=True)
        return 1
    print("gpu_check: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]) if sys.argv[1:2] in (["preflight"], ["beta"], ["fp8"]) else main())
