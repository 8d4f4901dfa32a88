"""One Markdown (optionally HTML) report for a sweep folder (same as ``megatron-grpo report``).

The report lives in ``megatron_grpo.plots``; this script is kept for existing commands.

    python tools/report.py runs/sweep-tiny [--seed 0] [--html]
"""

from __future__ import annotations

import argparse

from megatron_grpo.plots import SECTIONS, build_report  # noqa: F401


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--html", action="store_true")
    args = parser.parse_args(argv)
    print(build_report(args.sweep, args.seed, args.html))


if __name__ == "__main__":
    main()
