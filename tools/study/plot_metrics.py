"""The write-up's figures as PNG from one or more runs' ``metrics.jsonl`` (same as ``megatron-grpo plot``).

The figures live in ``megatron_grpo.observe.plots``; this script is kept for existing commands.

    python tools/study/plot_metrics.py runs/sweep-tiny/*/seed0 --out runs/sweep-tiny/figures
"""

from __future__ import annotations

import argparse

from megatron_grpo.observe.plots import (LINE_FIGURES, MOE_FIGURES, clip_figure, line_figure, load_runs,  # noqa: F401
                                 make_figures, rarity_figure, ratio_scatter, routing_beta_figure, timing_figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--out", required=True, help="folder for the PNGs")
    args = parser.parse_args(argv)
    for path in make_figures(args.runs, args.out):
        print(path)


if __name__ == "__main__":
    main()
