"""One Markdown (optionally HTML) report for a sweep folder (same as ``megatron-grpo report``).

The report lives in ``megatron_grpo.observe.plots``; this script is kept for existing commands.

    python tools/report.py runs/sweep-tiny [--seed 0] [--html]
    python tools/report.py runs/writeup-pretrained --writeup docs/results/writeup-reproduction.md
    python tools/report.py runs/writeup-regime --regime docs/results/writeup-regime.md --export docs/results/writeup-regime
"""

from __future__ import annotations

import argparse
import json
import os

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
    if args.regime:
        import writeup_regime

        if args.export:
            print(f"{len(writeup_regime.export_metrics(args.sweep, args.export))} files -> {args.export}")
        print(writeup_regime.write_page(args.sweep, doc=args.regime))
        return
    if args.writeup:
        import writeup

        p = json.load(open(os.path.join(args.sweep, "writeup.json")))
        print(writeup.write_report(args.sweep, p["table_lr"], p["scan_seeds"], p["seeds"], p["threshold"],
                                   doc=args.writeup, eps=p.get("eps"),
                                   family_seeds=p.get("family_seeds"), scan_lrs=p.get("scan_lrs")))
        return
    print(build_report(args.sweep, args.seed, args.html))


if __name__ == "__main__":
    main()
