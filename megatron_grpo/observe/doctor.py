"""The precision doctor: reads a run's ``metrics.jsonl`` (and ``config.yaml``) and says whether the
trainer/generator precision gap hurts it, with numbers and the fixes ranked as in MECHANISM.md.

    megatron-grpo doctor RUN_DIR

Diagnostics read files, not live objects, so they work on any past run. Thresholds
(docs/guides/precision-and-diagnostics.md) are the constants below; every one is a mean over the run's steps unless named.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import yaml

from megatron_grpo.observe.metrics_logger import read_metrics_rows

PHANTOM_ZERO_GRAD = 0.01
"""Phantom clipping is a problem when it zeroes more than 1% of token gradients (mean over steps)."""
BETA_GROWTH = 2.0
"""beta grows when mean |beta| of the last steps is this many times that of the first ones ..."""
BETA_FLOOR = 1e-3
"""... and above this (nats; below it the gap is numerical noise)."""
DRIFT_GROWTH = 2.0
"""Parity drift: the probe's mean |diff| of the last steps is this many times that of the first ones ..."""
DRIFT_FLOOR = 1e-3
"""... and above this (nats; an fp32-matched probe sits near 1e-6)."""
ROUTE_MISMATCH = 0.01
"""MoE: more than 1% of (token, layer) routing decisions differ between trainer and generator."""
MASKED_MOST = 0.5
"""A correction masks most tokens: more than half the valid tokens get weight 0."""
WINDOW = 5
"""First / last window (steps) compared for growth."""


@dataclass
class Finding:
    """One diagnosis: ``kind`` (stable id), ``severity`` (problem: damage above a threshold; warning:
    a cause whose damage is still below them), a sentence, and fixes."""

    kind: str
    severity: str
    message: str
    fixes: List[str] = field(default_factory=list)


def read_metrics(run_dir: str) -> List[Dict[str, Any]]:
    """The rows of ``<run_dir>/metrics.jsonl`` (a path to the file works too); null -> NaN."""
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is this a run's logger.log_dir?)")
    rows = read_metrics_rows(path)
    return [{k: (math.nan if v is None else v) for k, v in row.items()} for row in rows]


def read_config(run_dir: str) -> Optional[Dict[str, Any]]:
    """The resolved config the trainer wrote at start (``config.yaml``), or None for older runs."""
    folder = os.path.dirname(run_dir) if run_dir.endswith(".jsonl") else run_dir
    path = os.path.join(folder, "config.yaml")
    if not os.path.isfile(path):
        return None

    with open(path) as f:
        return yaml.safe_load(f)


def series(rows: Sequence[Dict[str, Any]], key: str) -> List[float]:
    """The finite values of ``key`` over the steps, in order."""
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def num_sampled(rows: Sequence[Dict[str, Any]], key: str) -> int:
    """Steps whose row has ``key`` (``grpo.diagnostics_every`` > 1 leaves it out of the others)."""
    return sum(1 for r in rows if key in r)


def sampled_note(rows: Sequence[Dict[str, Any]], key: str) -> str:
    """``" (3 of 10 steps sampled)"`` when only some rows have ``key``, else ``""``."""
    k = num_sampled(rows, key)
    return f" ({k} of {len(rows)} steps sampled)" if 0 < k < len(rows) else ""


def _precision(config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    p = (config or {}).get("policy", {}).get("precision", {})
    return {"params": p.get("params_dtype"), "compute": p.get("compute_dtype"),
            "generation": p.get("generation_dtype"), "shadow": p.get("shadow_dtype"), "fp8": p.get("fp8") or {}}


def _fp8_generator(config: Optional[Dict[str, Any]]) -> bool:
    """The generator runs FP8 (the trainer never does here: compute_dtype is float32 / bfloat16 / float16)."""
    return _precision(config)["generation"] == "fp8"


def _loss(config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    return (config or {}).get("loss_fn", {})


def precision_fixes(config: Optional[Dict[str, Any]]) -> List[str]:
    """MECHANISM.md's fixes, strongest first, as the overrides to type (those already in effect left out)."""
    if _fp8_generator(config):
        return fp8_fixes(config)
    p, loss = _precision(config), _loss(config)
    gen = p["generation"] or "bfloat16"
    fp32_params = "" if p["params"] in (None, "float32") else "policy.precision.params_dtype=float32 "
    fixes = []
    if not (p["compute"] == "float16" and gen == "float16"):
        fixes.append(f"fp16 training and fp16 generation (mismatch structurally 0): {fp32_params}"
                     "policy.precision.compute_dtype=float16 policy.precision.generation_dtype=float16")
    if p["compute"] != gen:
        how = ("bf16 autocast with fp32 master weights (the usual mixed-precision recipe)" if gen == "bfloat16"
               else f"compute in the generator's precision, {gen}")
        fixes.append(f"{how}: {fp32_params}policy.precision.compute_dtype={gen}")
    if loss.get("ratio", "train") != "shadow":
        fixes.append("take the PPO ratio from the shadow forward (gradients still from the trainer's pass): "
                     "loss_fn.ratio=shadow")
    if loss.get("ratio_clip_min", 0.2) < 1:
        fixes.append("no clip (very large eps): loss_fn.ratio_clip_min=10 loss_fn.ratio_clip_max=10")
    if loss.get("clip", "ppo") not in ("detach", "detach_center"):
        fixes.append("detached gradient weights (least stable): loss_fn.clip=detach_center")
    return fixes


def fp8_fixes(config: Optional[Dict[str, Any]]) -> List[str]:
    """An fp8 generator beside a bf16 / fp32 trainer, the field's fixes strongest first (those in effect left
    out): the PPO ratio from the generator's own FP8 forward (miles' "unified FP8", NeMo-RL's QARL: with the
    megatron generator it is the generator's computation exactly), an importance-sampling correction of the gap
    (verl's FP8 rollouts), and bf16 first / last decoder layers (a smaller gap)."""
    p, loss = _precision(config), _loss(config)
    fixes = []
    if p["shadow"] != "fp8" or loss.get("ratio", "train") != "shadow":
        fixes.append("take the PPO ratio from the generator's FP8 forward, the shadow (\"unified FP8\"; gradients "
                     "still from the trainer's pass): policy.precision.shadow_dtype=fp8 loss_fn.ratio=shadow")
    if not loss.get("correction"):
        fixes.append("correct the rollout gap by truncated importance sampling: loss_fn.correction=tis")
    if not (p["fp8"].get("num_first_layers_in_bf16") or p["fp8"].get("num_last_layers_in_bf16")):
        fixes.append("keep the first and last decoder layers in bf16 (a smaller gap): "
                     "policy.precision.fp8.num_first_layers_in_bf16=2 policy.precision.fp8.num_last_layers_in_bf16=2")
    return fixes


def _dtypes_sentence(config: Optional[Dict[str, Any]]) -> str:
    p = _precision(config)
    if p["compute"] is None:
        return "the trainer's and the generator's precisions differ (no config.yaml in the run dir to name them)"
    if _fp8_generator(config):
        f8 = p["fp8"]
        blocks = f" (blockwise e4m3, blocks {f8.get('weight_block_size')} / {f8.get('activation_block_size')})" \
            if f8 else ""
        return f"an fp8 generator{blocks} beside a {p['compute']} trainer"
    return f"the trainer computes in {p['compute']} while the generator runs {p['generation']}"


def check_phantom(rows, config) -> List[Finding]:
    """Phantom clipping: tokens whose gradient the precision gap alone zeroes."""
    phantom = mean(series(rows, "clip/phantom_zero_grad_fraction"))
    legit = mean(series(rows, "clip/legit_zero_grad_fraction"))
    beta = mean(series(rows, "precision/beta_abs_mean"))
    if not math.isfinite(phantom) or phantom <= PHANTOM_ZERO_GRAD:
        return []
    region = mean(series(rows, "clip/phantom_region_fraction"))
    beta_max = max(series(rows, "precision/beta_abs_max"), default=math.nan)
    message = (f"phantom clipping zeroes {phantom:.1%} of token gradients (legitimate: {legit:.1%}; "
               f"{region:.1%} of tokens pushed outside the trust region by the precision gap, mean |beta| "
               f"{beta:.2e}{'' if math.isnan(beta_max) else f', max |beta| {beta_max:.2e}'})"
               f"{sampled_note(rows, 'clip/phantom_zero_grad_fraction')}; {_dtypes_sentence(config)}")
    return [Finding("phantom_clipping", "problem", message, precision_fixes(config))]


def _mismatched(rows, config) -> bool:
    """The trainer computes in another precision than the generator: by the config, else (no
    config.yaml) by a non-zero measured beta (exactly 0 when they match)."""
    p = _precision(config)
    if p["compute"] is not None:
        return (p["generation"] or p["compute"]) != p["compute"]
    beta = mean(series(rows, "precision/beta_abs_mean"))
    return math.isfinite(beta) and beta > 0


def check_mismatch(rows, config) -> List[Finding]:
    """Mismatched precisions, named whenever they are, with the damage measured so far, even below
    the phantom-clipping threshold: the gap enters every PPO ratio, and the write-up's fp32-vs-bf16 run
    had 13.5% of its gradients zeroed by step 3. Left to ``check_phantom`` when that one triggers (its
    finding names the precisions and gives the same fixes)."""
    phantom = mean(series(rows, "clip/phantom_zero_grad_fraction"))
    if not _mismatched(rows, config) or (math.isfinite(phantom) and phantom > PHANTOM_ZERO_GRAD):
        return []
    beta, beta_max = series(rows, "precision/beta_abs_mean"), series(rows, "precision/beta_abs_max")
    measured = [f"mean |beta| {mean(beta):.2e}" if beta else "beta not measured (no shadow forward)"]
    if beta_max:
        measured.append(f"max |beta| {max(beta_max):.2e}")
    if math.isfinite(phantom):
        legit = mean(series(rows, "clip/legit_zero_grad_fraction"))
        region = mean(series(rows, "clip/phantom_region_fraction"))
        measured.append(f"phantom clipping zeroes {phantom:.1%} of token gradients (legitimate: {legit:.1%}; "
                        f"{region:.1%} of tokens pushed outside the trust region by the gap)")
    message = (f"mismatched precisions: {_dtypes_sentence(config)}; over {len(rows)} steps"
               f"{sampled_note(rows, 'precision/beta_abs_mean')} {', '.join(measured)}. "
               "Below the problem thresholds so far, but the gap is in every PPO ratio (the write-up's "
               "fp32-vs-bf16 run: 13.5% of gradients zeroed at step 3, 17.2% of tokens phantom-clipped at step 5; "
               "it did not learn)")
    return [Finding("precision_mismatch", "warning", message, precision_fixes(config))]


def _growth(values: Sequence[float]) -> tuple:
    """(first-window mean, last-window mean) when there are two distinct windows, else (nan, nan)."""
    if len(values) < 2:
        return math.nan, math.nan
    w = max(1, min(WINDOW, len(values) // 2))
    return mean(values[:w]), mean(values[-w:])


def check_growth(rows, config) -> List[Finding]:
    """beta rising over the run (mismatch KL rising until collapse: NeMo-RL #1801) and parity drift."""
    found = []
    first, last = _growth(series(rows, "precision/beta_abs_mean"))
    if last > BETA_FLOOR and last > BETA_GROWTH * first:
        note = sampled_note(rows, "precision/beta_abs_mean")
        found.append(Finding("beta_growing", "problem",
                             f"the precision gap grows over the run: mean |beta| {first:.2e} -> {last:.2e} "
                             f"(first vs last {WINDOW} {'sampled ' if note else ''}steps){note}; a rising "
                             "trainer/generator mismatch precedes collapse (NeMo-RL #1801)",
                             precision_fixes(config)[:2]))
    first, last = _growth(series(rows, "sync/logprob_abs_diff_mean"))
    if last > DRIFT_FLOOR and last > DRIFT_GROWTH * first:
        found.append(Finding("parity_drift", "problem",
                             f"parity-probe drift: the generator's and the trainer's log-probs on the fixed probe "
                             f"set moved apart, mean |diff| {first:.2e} -> {last:.2e} (first vs last {WINDOW} "
                             "steps); the pushed weights or the generator's kernels diverge from the trainer's",
                             ["check the weight push (sync/push_s, the pushed names) and the generator's dtype: "
                              "policy.precision.generation_dtype", "lower the tolerance to stop earlier: "
                              "generation.parity_growth=2"]))
    return found


def check_moe_and_correction(rows, config) -> List[Finding]:
    """MoE routing mismatch and corrections that mask most tokens."""
    found = []
    routes = mean(series(rows, "moe/route_mismatch_fraction"))
    replay = (config or {}).get("policy", {}).get("megatron_cfg", {}).get("moe_routing_replay", "none")
    if math.isfinite(routes) and routes > ROUTE_MISMATCH:
        fixes = [] if replay != "none" else ["replay the generator-precision routing in the training forward: "
                                             "policy.megatron_cfg.moe_routing_replay=R2 (R3 on GPU)"]
        found.append(Finding("moe_route_mismatch", "problem",
                             f"MoE routing mismatch: {routes:.1%} of (token, layer) expert choices differ between "
                             f"the training forward and the generator-precision shadow (replay: {replay})", fixes))
    masked = mean(series(rows, "correction/masked_fraction"))
    if math.isfinite(masked) and masked > MASKED_MOST:
        name = _loss(config).get("correction") or "the correction"
        found.append(Finding("correction_masks_most", "problem",
                             f"{name} masks {masked:.1%} of valid tokens (weight 0): most of the batch teaches "
                             "nothing", ["widen its band (loss_fn.icepop_low / icepop_high, seq_mask_low / "
                                         "seq_mask_high) or close the gap it measures"] + precision_fixes(config)[:2]))
    return found


def check_skips(rows, config) -> List[Finding]:
    skipped = sum(series(rows, "train/skipped_nonfinite"))
    if skipped <= 0:
        return []
    return [Finding("nonfinite_skips", "problem", f"{int(skipped)} step(s) skipped for non-finite values")]


CHECKS = (check_phantom, check_mismatch, check_growth, check_moe_and_correction, check_skips)


def diagnose(rows: Sequence[Dict[str, Any]], config: Optional[Dict[str, Any]] = None) -> List[Finding]:
    """Every finding of every check (empty: healthy)."""
    return [f for check in CHECKS for f in check(rows, config)]


def healthy_sentence(rows, config) -> str:
    beta = mean(series(rows, "precision/beta_abs_mean"))
    phantom = mean(series(rows, "clip/phantom_zero_grad_fraction"))
    p = _precision(config)
    where = (f"trainer computes in {p['compute']}, generator runs {p['generation']}" if p["compute"]
             else "precisions not recorded")
    if not math.isfinite(beta):
        gap = "no precision metrics logged"
    else:
        gap = ("beta = 0 exactly" if beta == 0 else f"mean |beta| {beta:.2e}") + sampled_note(
            rows, "precision/beta_abs_mean")
    clip = "" if not math.isfinite(phantom) else f", phantom clipping zeroes {phantom:.2%} of token gradients"
    return f"healthy: no precision problem found ({where}; {gap}{clip})"


def format_verdict(findings: Sequence[Finding], rows, config) -> str:
    """The doctor's text: one paragraph per finding with its fixes, strongest first."""
    if not findings:
        return healthy_sentence(rows, config)
    lines = []
    for f in findings:
        lines.append(f"{f.severity}: {f.message}.")
        if f.fixes:
            lines.append("  Fixes, strongest first:" if len(f.fixes) > 1 else "  Fix:")
            lines += [f"    {i}. {fix}" for i, fix in enumerate(f.fixes, 1)]
    return "\n".join(lines)


def doctor(run_dir: str) -> int:
    """``megatron-grpo doctor RUN_DIR``: prints the verdict; 0 healthy, 1 problems or warnings found."""
    rows, config = read_metrics(run_dir), read_config(run_dir)
    if not rows:
        print(f"{run_dir}: metrics.jsonl has no steps yet")
        return 0
    findings = diagnose(rows, config)
    print(f"{run_dir}: {len(rows)} steps")
    print(format_verdict(findings, rows, config))
    return 1 if findings else 0


class LiveDoctor:
    """The same checks during training: each finding is reported once, when it first triggers."""

    MIN_STEPS = 3

    def __init__(self, config: Optional[Dict[str, Any]]):
        self.config, self.rows, self.reported = config, [], set()

    def update(self, step: int, metrics: Dict[str, float]) -> List[str]:
        """Adds a step's metrics; returns the messages of findings not reported before."""
        self.rows.append({"step": step, **metrics})
        if len(self.rows) < self.MIN_STEPS:
            return []
        new = [f for f in diagnose(self.rows, self.config) if f.kind not in self.reported]
        self.reported.update(f.kind for f in new)
        return [f"doctor (step {step}): " + format_verdict([f], self.rows, self.config) for f in new]
