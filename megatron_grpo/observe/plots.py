"""Figures and the sweep report from runs' ``metrics.jsonl`` (``megatron-grpo plot`` / ``report``).

Each run is a folder (or a metrics.jsonl path); its label is the folder's path below the
common root. Figures: reward, beta, alpha, SNR, deployed improvement and KL over steps; clip
fractions split into phantom / legit / rescued; |beta| by token rarity; the per-phase time of a
step; MoE routing agreement when logged; and, when a run dumped tokens
(``logger.token_dump_steps``), the actual-vs-clean ratio scatter of one step against the clip
boundaries. One run per colour; axis labels and legends. matplotlib (the ``tools`` extra) is
imported on first use.

    megatron-grpo plot runs/sweep-tiny/*/seed0 --out runs/sweep-tiny/figures
    megatron-grpo report runs/sweep-tiny [--seed 0] [--html]
"""

from __future__ import annotations

import glob
import html
import json
import math
import os
from typing import Dict, List

from megatron_grpo.observe.metrics_logger import read_metrics_rows

_PLT = None


def _pyplot():
    """matplotlib.pyplot with the Agg backend, imported once, on first use."""
    global _PLT
    if _PLT is None:
        try:
            import matplotlib
        except ImportError as exc:
            raise SystemExit("plots need matplotlib: pip install '.[tools]'") from exc
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        _PLT = plt
    return _PLT


LINE_FIGURES = {
    "beta.png": ("precision/beta_abs_mean", "mean |beta| (precision gap)"),
    "alpha.png": ("precision/alpha_abs_mean", "mean |alpha| (policy change + lag)"),
    "snr.png": ("precision/snr", "SNR = mean|alpha| / mean|beta|"),
    "deployed_improvement.png": ("policy/deployed_improvement", "deployed improvement per step"),
    "kl_rollout.png": ("policy/kl_rollout", "KL(current || rollout), k3"),
    "reward.png": ("reward/mean", "mean reward"),
}


def load_runs(paths: List[str]) -> Dict[str, List[dict]]:
    files = [p if p.endswith(".jsonl") else os.path.join(p, "metrics.jsonl") for p in paths]
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise SystemExit(f"no metrics.jsonl under {paths}")
    root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files]) if len(files) > 1 else None
    runs = {}
    for f in files:
        folder = os.path.dirname(os.path.abspath(f))
        label = os.path.relpath(folder, root) if root and folder != root else os.path.basename(folder)
        runs[label] = read_metrics_rows(f)
    return runs


def _xy(rows, key):
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _sampled(rows, x) -> str:
    """A legend note when a metric is logged on only some steps (``grpo.diagnostics_every`` > 1):
    the line joins the sampled steps, each marked."""
    return f" ({len(x)} of {len(rows)} steps sampled)" if len(x) < len(rows) else ""


def _marker(rows, x):
    return "o" if len(x) < len(rows) else None


def line_figure(runs: Dict[str, List[dict]], key: str, title: str):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, rows) in enumerate(runs.items()):
        x, y = _xy(rows, key)
        if x:
            ax.plot(x, y, label=label + _sampled(rows, x), color=f"C{i % 10}", marker=_marker(rows, x))
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title)
    if key == "precision/snr":
        ax.set_yscale("log")
    if ax.get_lines():
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, f"no {key} in these runs", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig


def clip_figure(runs: Dict[str, List[dict]]):
    """One panel per run: phantom / legit / rescued region fractions over steps."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.2 * len(runs)), squeeze=False, sharex=True)
    for ax, (label, rows) in zip(axes[:, 0], runs.items()):
        for j, kind in enumerate(("phantom", "legit", "rescued")):
            x, y = _xy(rows, f"clip/{kind}_region_fraction")
            if x:
                ax.plot(x, y, label=kind + _sampled(rows, x), color=f"C{j}", marker=_marker(rows, x))
        ax.set_ylabel("fraction of tokens")
        ax.set_title(label, fontsize=8)
        if ax.get_lines():
            ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    return fig


def bar_groups(runs: Dict[str, List[dict]], keys: List[str], labels: List[str], ylabel: str, title: str):
    """One bar group per run: the mean over steps of each metric in ``keys``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(runs), 1)
    for i, (label, rows) in enumerate(runs.items()):
        means = []
        for key in keys:
            _, y = _xy(rows, key)
            means.append(sum(y) / len(y) if y else 0.0)
        ax.bar([k + i * width for k in range(len(keys))], means, width=width, label=label, color=f"C{i % 10}")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels(labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def rarity_figure(runs: Dict[str, List[dict]]):
    """Mean |beta| by rollout log-prob bucket (common > -5, medium, rare <= -20), one bar group per run."""
    return bar_groups(runs, [f"precision/beta_abs_mean_{b}" for b in ("common", "medium", "rare")],
                      ["common (lp > -5)", "medium", "rare (lp <= -20)"], "mean |beta|",
                      "precision gap by token rarity")


MOE_FIGURES = {
    "moe_route_mismatch.png": ("moe/route_mismatch_fraction", "(token, layer) routing decisions: trainer != shadow"),
    "moe_tokens_any_mismatch.png": ("moe/tokens_any_mismatch", "tokens routed differently in some layer"),
}


def routing_beta_figure(runs: Dict[str, List[dict]]):
    """Mean |beta| of tokens whose routing matched the generator's in every layer vs not, per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(runs), 1)
    for i, (label, rows) in enumerate(runs.items()):
        means = []
        for part in ("match", "mismatch"):
            _, y = _xy(rows, f"precision/beta_abs_mean_route_{part}")
            means.append(sum(y) / len(y) if y else 0.0)
        ax.bar([k + i * width for k in range(2)], means, width=width, label=label, color=f"C{i % 10}")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(2)])
    ax.set_xticklabels(["routing matched", "routing differed (some layer)"])
    ax.set_ylabel("mean |beta|")
    ax.set_title("MoE: precision gap by routing agreement")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def ratio_scatter(dump: dict):
    """Actual ratio exp(alpha+beta) vs clean ratio exp(alpha) per token, with the clip boundaries."""
    plt = _pyplot()
    old, lp, sh = dump["old_log_probs"], dump["log_probs"], dump["shadow_log_probs"]
    clean = [math.exp(max(min(s - o, 20), -20)) for s, o in zip(sh, old)]
    actual = [math.exp(max(min(a - o, 20), -20)) for a, o in zip(lp, old)]
    lo, hi = max(0.0, 1 - dump["ratio_clip_min"]), 1 + dump["ratio_clip_max"]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(clean, actual, s=4, alpha=0.5, color="C0", label="tokens")
    for v in (lo, hi):
        ax.axvline(v, color="C3", lw=0.8)
        ax.axhline(v, color="C3", lw=0.8)
    ax.set_xlabel("clean ratio exp(alpha)")
    ax.set_ylabel("actual ratio exp(alpha + beta)")
    ax.set_title(f"step {dump['step']}: tokens outside the box on one axis only are phantom / rescued", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


PHASES = ("generate", "reward", "train", "weight_push", "parity")


def timing_figure(runs: Dict[str, List[dict]]):
    """Mean seconds per step of each phase (``timing/<phase>_s``), one bar group per run."""
    return bar_groups(runs, [f"timing/{phase}_s" for phase in PHASES], [p.replace("_", " ") for p in PHASES],
                      "seconds per step (mean)", "where a step's time goes")


def make_figures(paths: List[str], out: str) -> List[str]:
    """Writes every figure to ``out``; returns the PNG paths."""
    plt = _pyplot()
    runs = load_runs(paths)
    os.makedirs(out, exist_ok=True)
    figures = {name: line_figure(runs, key, title) for name, (key, title) in LINE_FIGURES.items()}
    figures["clip_fractions.png"] = clip_figure(runs)
    figures["beta_by_rarity.png"] = rarity_figure(runs)
    if any(k.startswith("timing/") for rows in runs.values() for r in rows for k in r):
        figures["timing.png"] = timing_figure(runs)
    if any("moe/route_mismatch_fraction" in r for rows in runs.values() for r in rows):
        figures.update({name: line_figure(runs, key, title) for name, (key, title) in MOE_FIGURES.items()})
        figures["beta_by_routing.png"] = routing_beta_figure(runs)
    for path in paths:
        for dump_path in sorted(glob.glob(os.path.join(path, "tokens_step*.json")))[:1]:
            with open(dump_path) as f:
                dump = json.load(f)
            norm = os.path.normpath(path)
            tag = f"{os.path.basename(os.path.dirname(norm))}_{os.path.basename(norm)}".strip("_")
            figures[f"ratio_scatter_{tag}.png"] = ratio_scatter(dump)
    written = []
    for name, fig in figures.items():
        target = os.path.join(out, name)
        fig.savefig(target, dpi=110)
        plt.close(fig)
        written.append(target)
    return written


SECTIONS = [
    ("Reward", "reward.png"), ("Precision gap |beta|", "beta.png"), ("|beta| by token rarity", "beta_by_rarity.png"),
    ("Policy movement |alpha|", "alpha.png"), ("SNR", "snr.png"), ("Clip fractions", "clip_fractions.png"),
    ("Deployed improvement", "deployed_improvement.png"), ("KL to the rollout policy", "kl_rollout.png"),
    ("Time per step by phase", "timing.png"),
]


def build_report(sweep: str, seed: int = 0, as_html: bool = False) -> str:
    run_dirs = sorted(d for d in glob.glob(os.path.join(sweep, "*", f"seed{seed}")) if os.path.isdir(d))
    if not run_dirs:
        raise SystemExit(f"no runs under {sweep}/*/seed{seed}")
    figures = os.path.join(sweep, "figures")
    written = make_figures(run_dirs, figures)
    summary_path = os.path.join(sweep, "summary.md")
    parts = ["# Precision-mismatch report", "", f"Sweep folder: `{sweep}` (figures from seed {seed}).", ""]
    if os.path.isfile(summary_path):
        parts += [open(summary_path).read(), ""]
    names = {os.path.basename(p) for p in written}
    for title, name in SECTIONS:
        if name in names:
            parts += [f"## {title}", "", f"![{title}](figures/{name})", ""]
    for path in written:
        if os.path.basename(path).startswith("ratio_scatter"):
            parts += ["## Ratio scatter", "", f"![ratio scatter](figures/{os.path.basename(path)})", ""]
    text = "\n".join(parts)
    target = os.path.join(sweep, "report.md")
    with open(target, "w") as f:
        f.write(text)
    if as_html:
        body = "".join(_html_line(line) for line in text.splitlines())
        with open(os.path.join(sweep, "report.html"), "w") as f:
            f.write(f"<html><body>{body}</body></html>")
    return target


def _html_line(line: str) -> str:
    if line.startswith("!["):
        alt, src = line[2:].split("](")
        return f'<img alt="{html.escape(alt)}" src="{html.escape(src[:-1])}"><br>'
    if line.startswith("#"):
        level = len(line) - len(line.lstrip("#"))
        return f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>"
    return f"<pre>{html.escape(line)}</pre>" if line.startswith("|") else f"<p>{html.escape(line)}</p>"
