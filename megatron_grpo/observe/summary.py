"""The end-of-run summary, computed from ``metrics.jsonl`` rows: printed on rank 0 and written to
``<log_dir>/summary.json`` after every run (also one stopped by SIGTERM/SIGINT or an error)."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from megatron_grpo.observe.doctor import WINDOW, diagnose, format_verdict, mean, num_sampled, read_metrics, series

PHASES = ("generate", "reward", "train", "weight_push", "parity")
"""The per-step ``timing/<phase>_s`` metrics, summed into the wall-time split."""

EDGE_METRICS = {
    "beta_abs_mean": "precision/beta_abs_mean",
    "phantom_region_fraction": "clip/phantom_region_fraction",
    "phantom_zero_grad_fraction": "clip/phantom_zero_grad_fraction",
    "legit_zero_grad_fraction": "clip/legit_zero_grad_fraction",
}
"""Reported as the mean over the first and the last ``WINDOW`` steps."""


def _finite(value: float) -> Optional[float]:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _edges(values: Sequence[float]) -> Dict[str, Optional[float]]:
    return {"first": _finite(mean(values[:WINDOW])), "last": _finite(mean(values[-WINDOW:]))}


def precision_sentence(config: Optional[Dict[str, Any]]) -> Optional[str]:
    """The run's precisions as the config names them (fp8 with its settings); None without a config."""
    p = (config or {}).get("policy", {}).get("precision")
    if not p:
        return None
    text = (f"params {p.get('params_dtype')}, trainer {p.get('compute_dtype')}, generator {p.get('generation_dtype')}, "
            f"shadow {p.get('shadow_dtype')}")
    f8 = p.get("fp8") or {}
    if "fp8" in (p.get("generation_dtype"), p.get("shadow_dtype")) and f8:
        pow2 = [name for name in ("weight", "activation") if f8.get(f"use_{name}_pow2_scale")]
        text += (f" (fp8: e4m3 weight blocks {f8.get('weight_block_size')}, activation groups "
                 f"{f8.get('activation_block_size')}, bf16 layers {f8.get('num_first_layers_in_bf16', 0)} first / "
                 f"{f8.get('num_last_layers_in_bf16', 0)} last, pow2 scales: {' and '.join(pow2) or 'none'})")
    return text


def summarize(rows: Sequence[Dict[str, Any]], config: Optional[Dict[str, Any]], *, wall_s: Optional[float] = None,
              planned_steps: Optional[int] = None, stopped: Optional[str] = None) -> Dict[str, Any]:
    """The summary as a JSON-able dict (every number computed from ``rows``, except ``wall_s``)."""
    reward, length = series(rows, "reward/mean"), series(rows, "completion/length_mean")
    timing = {p: sum(series(rows, f"timing/{p}_s")) for p in PHASES}
    findings = diagnose(rows, config)
    return {
        "steps": int(rows[-1]["step"]) if rows else 0,
        "planned_steps": planned_steps,
        "stopped": stopped,
        "precision": precision_sentence(config),
        "wall_s": _finite(wall_s) if wall_s is not None else sum(series(rows, "time/step_s")),
        "timing_s": timing,
        "reward": {"first": reward[0] if reward else None, "last": reward[-1] if reward else None,
                   "best": max(reward) if reward else None},
        "completion_length": {"first": length[0] if length else None, "last": length[-1] if length else None},
        **{name: _edges(series(rows, key)) for name, key in EDGE_METRICS.items()},
        "deployed_improvement_mean": _finite(mean(series(rows, "policy/deployed_improvement"))),
        "diagnostics_steps": {"precision": num_sampled(rows, "precision/beta_abs_mean"),
                              "deployed_improvement": num_sampled(rows, "policy/deployed_improvement")},
        "healthy": not findings,
        "doctor": format_verdict(findings, rows, config),
    }


def _paths(config: Optional[Dict[str, Any]], log_dir: str) -> Dict[str, Optional[str]]:
    ck = (config or {}).get("checkpointing", {})
    events = os.path.isdir(log_dir) and any(n.startswith("events.out.tfevents") for n in os.listdir(log_dir))
    return {"metrics": os.path.join(log_dir, "metrics.jsonl"), "tensorboard": log_dir if events else None,
            "checkpoints": ck.get("checkpoint_dir"), "config": os.path.join(log_dir, "config.yaml")}


def _commands(paths: Dict[str, Optional[str]], log_dir: str) -> Dict[str, str]:
    resume = (f"megatron-grpo train {paths['config']} checkpointing.resume=true" if paths["checkpoints"]
              else "no checkpoints: set checkpointing.checkpoint_dir to make the run resumable")
    return {"plot": f"megatron-grpo plot {log_dir} --out {os.path.join(log_dir, 'figures')}",
            "doctor": f"megatron-grpo doctor {log_dir}", "resume": resume}


def _num(value: Optional[float], fmt: str = ".3f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _sampled(s: Dict[str, Any], what: str) -> str:
    """``" (3 of 10 steps sampled)"`` when ``grpo.diagnostics_every`` left ``what`` out of some steps."""
    k = s.get("diagnostics_steps", {}).get(what, 0)
    return f" ({k} of {s['steps']} steps sampled)" if 0 < k < s["steps"] else ""


def format_summary(s: Dict[str, Any]) -> str:
    """The printed summary (about 12 lines plus the doctor's fixes)."""
    steps = f"{s['steps']}" + (f"/{s['planned_steps']}" if s["planned_steps"] else "")
    stop = f", stopped early ({s['stopped']})" if s["stopped"] else ""
    split = ", ".join(f"{p.replace('_', ' ')} {v:.1f}s" for p, v in s["timing_s"].items() if v > 0)
    r, n = s["reward"], s["completion_length"]
    lines = [
        "=" * 24 + " run summary " + "=" * 24,
        f"steps {steps}{stop}; wall time {_num(s['wall_s'], '.1f')}s ({split or 'no timing metrics'})",
        f"reward: first {_num(r['first'])}, last {_num(r['last'])}, best {_num(r['best'])}; "
        f"completion length: {_num(n['first'], '.1f')} -> {_num(n['last'], '.1f')}",
    ]
    if s.get("precision"):
        lines.append(f"precision: {s['precision']}")
    b, ph, pz, lz = (s[name] for name in EDGE_METRICS)
    sampled = _sampled(s, "precision")
    lines.append(f"first -> last {WINDOW} {'sampled ' if sampled else ''}steps{sampled}: mean |beta| "
                 f"{_num(b['first'], '.2e')} -> {_num(b['last'], '.2e')}")
    lines.append(f"  phantom-clipped tokens {_num(ph['first'], '.2%')} -> {_num(ph['last'], '.2%')}, gradients "
                 f"zeroed {_num(pz['first'], '.2%')} -> {_num(pz['last'], '.2%')} (legitimately: "
                 f"{_num(lz['first'], '.2%')} -> {_num(lz['last'], '.2%')})")
    lines.append(f"deployed improvement (mean per step{_sampled(s, 'deployed_improvement')}): "
                 f"{_num(s['deployed_improvement_mean'], '.2e')}")
    lines.append("doctor: " + s["doctor"])
    lines += [f"{k}: {v}" for k, v in s["paths"].items() if v]
    lines += [f"{k} with: {v}" if v.startswith("megatron-grpo") else f"{k}: {v}" for k, v in s["commands"].items()]
    return "\n".join(lines)


def write_summary(log_dir: str, config: Optional[Dict[str, Any]], **kwargs) -> Dict[str, Any]:
    """Reads ``<log_dir>/metrics.jsonl``, writes ``summary.json``; returns the summary (with paths, commands)."""
    path = os.path.join(log_dir, "metrics.jsonl")
    rows: List[Dict[str, Any]] = read_metrics(log_dir) if os.path.isfile(path) else []
    summary = summarize(rows, config, **kwargs)
    summary["paths"] = _paths(config, log_dir)
    summary["commands"] = _commands(summary["paths"], log_dir)
    os.makedirs(log_dir, exist_ok=True)
    tmp = os.path.join(log_dir, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(log_dir, "summary.json"))
    return summary
