"""The write-up's figures as PNG from one or more runs' ``metrics.jsonl``.

Each run is a folder (or a metrics.jsonl path); its label is the folder's path below the
common root. Figures: beta, alpha, SNR, deployed improvement and KL over steps; clip
fractions split into phantom / legit / rescued; |beta| by token rarity; and, when a run
dumped tokens (``logger.token_dump_steps``), the actual-vs-clean ratio scatter of one
step against the clip boundaries. One run per colour; axis labels and legends.

    python tools/plot_metrics.py runs/sweep-tiny/*/seed0 --out runs/sweep-tiny/figures
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
from typing import Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
        with open(f) as fh:
            runs[label] = [json.loads(line) for line in fh if line.strip()]
    return runs


def _xy(rows, key):
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def line_figure(runs: Dict[str, List[dict]], key: str, title: str):
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, rows) in enumerate(runs.items()):
        x, y = _xy(rows, key)
        if x:
            ax.plot(x, y, label=label, color=f"C{i % 10}")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title)
    if key == "precision/snr":
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def clip_figure(runs: Dict[str, List[dict]]):
    """One panel per run: phantom / legit / rescued region fractions over steps."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.2 * len(runs)), squeeze=False, sharex=True)
    for ax, (label, rows) in zip(axes[:, 0], runs.items()):
        for j, kind in enumerate(("phantom", "legit", "rescued")):
            x, y = _xy(rows, f"clip/{kind}_region_fraction")
            if x:
                ax.plot(x, y, label=kind, color=f"C{j}")
        ax.set_ylabel("fraction of tokens")
        ax.set_title(label, fontsize=8)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    return fig


def rarity_figure(runs: Dict[str, List[dict]]):
    """Mean |beta| by rollout log-prob bucket (common > -5, medium, rare <= -20), one bar group per run."""
    buckets = ("common", "medium", "rare")
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(runs), 1)
    for i, (label, rows) in enumerate(runs.items()):
        means = []
        for b in buckets:
            _, y = _xy(rows, f"precision/beta_abs_mean_{b}")
            means.append(sum(y) / len(y) if y else 0.0)
        ax.bar([k + i * width for k in range(3)], means, width=width, label=label, color=f"C{i % 10}")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(3)])
    ax.set_xticklabels(["common (lp > -5)", "medium", "rare (lp <= -20)"])
    ax.set_ylabel("mean |beta|")
    ax.set_title("precision gap by token rarity")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


MOE_FIGURES = {
    "moe_route_mismatch.png": ("moe/route_mismatch_fraction", "(token, layer) routing decisions: trainer != shadow"),
    "moe_tokens_any_mismatch.png": ("moe/tokens_any_mismatch", "tokens routed differently in some layer"),
}


def routing_beta_figure(runs: Dict[str, List[dict]]):
    """Mean |beta| of tokens whose routing matched the generator's in every layer vs not, per run."""
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


def make_figures(paths: List[str], out: str) -> List[str]:
    """Writes every figure to ``out``; returns the PNG paths."""
    runs = load_runs(paths)
    os.makedirs(out, exist_ok=True)
    figures = {name: line_figure(runs, key, title) for name, (key, title) in LINE_FIGURES.items()}
    figures["clip_fractions.png"] = clip_figure(runs)
    figures["beta_by_rarity.png"] = rarity_figure(runs)
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--out", required=True, help="folder for the PNGs")
    args = parser.parse_args(argv)
    for path in make_figures(args.runs, args.out):
        print(path)


if __name__ == "__main__":
    main()
