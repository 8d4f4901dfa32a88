"""One Markdown (optionally HTML) report for a sweep folder (same as ``megatron-grpo report``).

The report lives in ``megatron_grpo.observe.plots``; this script is kept for existing commands. ``--writeup`` and
``--regime`` hand over to ``tools/study/writeup.py --report`` / ``tools/study/writeup_regime.py --page`` (child processes).

    python tools/study/report.py runs/sweep-tiny [--seed 0] [--html]
    python tools/study/report.py runs/writeup-pretrained --writeup docs/results/writeup-reproduction.md
    python tools/study/report.py runs/writeup-regime --regime docs/results/writeup-regime.md --export docs/results/writeup-regime
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megatron_grpo.observe.plots import SECTIONS, build_report  # noqa: F401


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--html", action="store_true")
    parser.add_argument("--writeup", default=None, metavar="DOC",
                        help="a --grid writeup-pretrained sweep: write its reproduction page (and figures) to DOC")
    parser.add_argument("--regime", default=None, metavar="DOC",
                        help="a --grid writeup-regime sweep: write its page to DOC")
    parser.add_argument("--export", default=None, metavar="DIR",
                        help="with --regime: copy every run's raw metrics.jsonl / summary.json to DIR")
    args = parser.parse_args(argv)
    tools = os.path.dirname(os.path.abspath(__file__))
    if args.regime:
        cmd = ["writeup_regime.py", "--out", args.sweep, "--page", args.regime]
        cmd += ["--export", args.export] if args.export else []
    elif args.writeup:
        cmd = ["writeup.py", "--out", args.sweep, "--report", args.writeup]
    else:
        print(build_report(args.sweep, args.seed, args.html))
        return
    subprocess.run([sys.executable, os.path.join(tools, cmd[0])] + cmd[1:], check=True)


if __name__ == "__main__":
    main()
