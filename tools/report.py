"""One Markdown (optionally HTML) report for a sweep folder: the summary table and the figures.

    python tools/report.py runs/sweep-tiny [--seed 0] [--html]
"""

from __future__ import annotations

import argparse
import glob
import html
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plot_metrics import make_figures  # noqa: E402

SECTIONS = [
    ("Reward", "reward.png"), ("Precision gap |beta|", "beta.png"), ("|beta| by token rarity", "beta_by_rarity.png"),
    ("Policy movement |alpha|", "alpha.png"), ("SNR", "snr.png"), ("Clip fractions", "clip_fractions.png"),
    ("Deployed improvement", "deployed_improvement.png"), ("KL to the rollout policy", "kl_rollout.png"),
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
    for title, name in SECTIONS:
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--html", action="store_true")
    args = parser.parse_args(argv)
    print(build_report(args.sweep, args.seed, args.html))


if __name__ == "__main__":
    main()
