"""Benchmark: chunked ``token_log_probs`` vs naive ``log_softmax(logits.float()).gather``.

Side by side in one run, each variant in its own subprocess (so peak memory is its own):
peak extra resident memory over the input logits, and wall time of forward (+ backward).
Prints the two ratios last. Usage: python tools/bench/bench_logprobs.py [--tokens 8192] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _child(variant: str, tokens: int, vocab: int, dtype_name: str, backward: bool) -> dict:
    import torch

    from megatron_grpo.parallel.logprobs import token_log_probs

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    logits = torch.randn(tokens, vocab, dtype=dtype).requires_grad_(backward)
    labels = torch.randint(0, vocab, (tokens,))
    base = _rss_mib()
    start = time.perf_counter()
    if variant == "naive":
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    else:
        lp = token_log_probs(logits, labels)
    if backward:
        lp.sum().backward()
    seconds = time.perf_counter() - start
    return {"variant": variant, "seconds": seconds, "peak_extra_mib": _rss_mib() - base,
            "input_mib": logits.numel() * logits.element_size() / 2**20}


def _run(variant, args) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
           "--dtype", args.dtype] + (["--backward"] if args.backward else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.tokens, args.vocab, args.dtype, args.backward)))
        return
    naive, ours = _run("naive", args), _run("chunked", args)
    for r in (naive, ours):
        print(f"{r['variant']:>8}: {r['seconds']:.2f} s, peak extra memory {r['peak_extra_mib']:.0f} MiB "
              f"(input logits {r['input_mib']:.0f} MiB)")
    print(f"tokens={args.tokens} vocab={args.vocab} dtype={args.dtype} backward={args.backward}")
    print(f"memory ratio (chunked / naive): {ours['peak_extra_mib'] / max(naive['peak_extra_mib'], 1e-9):.3f}  (goal <= 0.125)")
    print(f"time ratio   (chunked / naive): {ours['seconds'] / naive['seconds']:.3f}  (goal <= 1.0)")


if __name__ == "__main__":
    main()
