"""Fault drill: inject the faults a long RL run meets and check what was lost.

Every drill runs the tiny recipe (CPU) with a checkpoint every step and is compared with one
uninterrupted run of the same recipe:
  - SIGKILL between steps 3 and 4, then ``checkpointing.resume=true``;
  - the same for an async run (``generation.max_staleness=1``: step 4's generation is in flight at the
    checkpoint), compared with an uninterrupted async run;
  - SIGTERM to one rank of a 2-rank torchrun run (the other must not hang), then resume;
  - SIGTERM to the whole process group (what Slurm sends), then resume;
  - the vLLM generator killed during generation, during the weight push and during the probe;
  - the vLLM generator killed during generation, then killed again while it restarts;
  - the vLLM server killed before step 2's generation;
  - a torn last line in metrics.jsonl (a full disk), then resume;
  - a garbage ``manifest.json`` in the newest checkpoint and an empty ``latest`` pointer, then resume
    with ``checkpointing.fallback_to_previous=true``;
  - a NaN in one micro-batch's log-probs (the step is skipped: its metrics differ by design).
Prints a table: fault, recovered, steps lost, rows lost or duplicated, metrics equal to the
uninterrupted run.

    python tools/cluster/fault_drill.py [--model DIR] [--out runs/fault-drill] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from megatron_grpo.observe.experiments import read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo
STEPS = 5
VOLATILE = ("time/", "timing/", "sync/push_s", "sync/logprob_diff_vs_baseline")
"""Not compared: wall times, and the probe's ratio to its baseline, a ratio of two fp32 round-off
numbers (~1e-7) that differs between layouts (the 2-rank drill against the 1-process run) while
the absolute diffs it is made of agree."""
PREEMPTED = 75


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(extra or {})
    return env


def _cmd(args, log_dir, nproc=1):
    launcher = [sys.executable, "-m", "megatron_grpo"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "megatron_grpo"]
    return launcher + ["train", "recipes/grpo-tiny-eos-cpu.yaml", f"logger.log_dir={log_dir}",
                       "logger.progress_bar=false", f"grpo.max_num_steps={STEPS}"] + list(args)


def run(args, log_dir, env_extra=None, nproc=1):
    proc = subprocess.run(_cmd(args, log_dir, nproc), cwd=ROOT, env=_env(env_extra), capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def run_and_signal(args, log_dir, after_rows: int, whole_group: bool, nproc=1):
    """Starts a run, waits for ``after_rows`` metric rows, then SIGTERMs one rank (the youngest
    worker process) or the whole process group; returns the exit code."""
    proc = subprocess.Popen(_cmd(args, log_dir, nproc), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 900
    while len(read_rows(log_dir)) < after_rows and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if whole_group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        os.kill(_youngest_worker(proc.pid), signal.SIGTERM)
    return proc.wait(timeout=900)


def _youngest_worker(launcher_pid: int) -> int:
    """torchrun's last worker (rank 1 of 2): the child of the launcher with the highest pid."""
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    return max(int(p) for p in out) if out else launcher_pid


def _summary(log_dir) -> dict:
    path = os.path.join(log_dir, "summary.json")
    return json.load(open(path)) if os.path.isfile(path) else {}


def _stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _equal(a, b) -> bool:
    a, b = _stable(a), _stable(b)
    if set(a) != set(b):
        return False
    for key, x in a.items():
        y = b[key]
        if x is None or y is None:
            if x is not y:
                return False
        elif not math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6):
            return False
    return True


def verdict(name, code, rows, reference, compare=True):
    steps = [r["step"] for r in rows]
    equal = compare and len(rows) == len(reference) and all(_equal(a, b) for a, b in zip(reference, rows))
    return {"fault": name, "recovered": code == 0 and sorted(set(steps)) == list(range(1, STEPS + 1)),
            "steps_lost": STEPS - len(set(steps)), "rows_lost_or_duplicated": abs(len(steps) - len(set(steps)))
            + (STEPS - len(set(steps))), "metrics_equal": "yes" if equal else ("n/a" if not compare else "no")}


def _base(out, name, model):
    ck = os.path.join(out, name + "-ckpt")
    return os.path.join(out, name), ck, [f"policy.model_name={model}", "checkpointing.save_period=1",
                                         f"checkpointing.checkpoint_dir={ck}"]


def drill_kill(out, model, reference):
    log_dir, _, base = _base(out, "sigkill-after-step-3", model)
    run(base, log_dir, {"MEGATRON_GRPO_FAULT_KILL_AFTER_STEP": "3"})
    code, _ = run(base + ["checkpointing.resume=true"], log_dir)
    return verdict("SIGKILL after step 3, resume", code, read_rows(log_dir), reference)


def drill_kill_async(out, model):
    """SIGKILL after step 3 of an async run, resume: step 4 must train on the generation in flight at step 3's
    checkpoint (lag 1), as the uninterrupted async run does."""
    async_run = ["generation.max_staleness=1"]
    ref_dir = os.path.join(out, "uninterrupted-async")
    run([f"policy.model_name={model}"] + async_run, ref_dir)
    log_dir, _, base = _base(out, "sigkill-async", model)
    run(base + async_run, log_dir, {"MEGATRON_GRPO_FAULT_KILL_AFTER_STEP": "3"})
    code, _ = run(base + async_run + ["checkpointing.resume=true"], log_dir)
    return verdict("SIGKILL after step 3 of an async run (max_staleness 1), resume", code, read_rows(log_dir),
                   read_rows(ref_dir))


def drill_sigterm(out, model, reference, whole_group: bool):
    name = "sigterm-process-group" if whole_group else "sigterm-one-rank-of-2"
    log_dir, _, base = _base(out, name, model)
    nproc = 1 if whole_group else 2
    code = run_and_signal(base, log_dir, after_rows=2, whole_group=whole_group, nproc=nproc)
    # one process exits 75; torchrun turns any non-zero worker status into its own 1, so there the
    # preemption shows in summary.json (written by rank 0 after the agreed stop and the checkpoint)
    stopped = _summary(log_dir).get("stopped")
    if (code != PREEMPTED if nproc == 1 else (code == 0 or stopped != "signal")):
        return {"fault": name, "recovered": False, "steps_lost": STEPS, "rows_lost_or_duplicated": STEPS,
                "metrics_equal": f"no (exit {code}, summary stopped={stopped!r})"}
    code, _ = run(base + ["checkpointing.resume=true"], log_dir, nproc=nproc)
    label = "SIGTERM to the process group, resume" if whole_group else "SIGTERM to one rank of 2 (torchrun), resume"
    return verdict(label, code, read_rows(log_dir), reference)


def drill_generator(out, model, reference, spec, label, expect="generator failed during"):
    """``expect``: what the run's log says once the fault hit (a fault that never fired recovers nothing)."""
    log_dir, _, base = _base(out, "generator-" + spec.replace(":", "-").replace(",", "-"), model)
    code, log = run(base, log_dir, {"MEGATRON_GRPO_FAULT_KILL_GENERATOR": spec})
    result = verdict(label, code, read_rows(log_dir), reference)
    if expect not in log:
        result.update(fault=f"{label} (not injected: no '{expect}' in the log)", recovered=False)
    return result


def drill_server(out, model):
    log_dir, _, base = _base(out, "server-killed", model)
    code, _ = run(base + ["generation.backend=vllm_server", "generation.retry_timeout_s=5"], log_dir,
                  {"MEGATRON_GRPO_FAULT_KILL_GENERATOR": "generate:2"})
    return verdict("vLLM server killed before step 2", code, read_rows(log_dir), [], compare=False)


def drill_torn_metrics(out, model, reference):
    log_dir, _, base = _base(out, "torn-metrics-line", model)
    run(base, log_dir, {"MEGATRON_GRPO_FAULT_KILL_AFTER_STEP": "3"})
    with open(os.path.join(log_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "reward/mean": -1')  # a full disk tore the next row
    code, _ = run(base + ["checkpointing.resume=true"], log_dir)
    return verdict("torn last metrics line, resume", code, read_rows(log_dir), reference)


def drill_broken_metadata(out, model, reference):
    from megatron_grpo.checkpoint import folders as ckpt

    log_dir, ck, base = _base(out, "broken-manifest", model)
    run(base, log_dir, {"MEGATRON_GRPO_FAULT_KILL_AFTER_STEP": "3"})
    with open(os.path.join(ckpt.step_dir(ck, 3), "manifest.json"), "w") as f:
        f.write("{garbage")
    open(os.path.join(ck, "latest"), "w").close()  # and an empty pointer
    code, _ = run(base + ["checkpointing.resume=true", "checkpointing.fallback_to_previous=true"], log_dir)
    return verdict("garbage manifest + empty latest, fallback resume", code, read_rows(log_dir), reference)


def drill_nan(out, model):
    log_dir, _, base = _base(out, "nan-log-probs", model)
    code, _ = run(base, log_dir, {"MEGATRON_GRPO_FAULT_NAN_STEP": "2"})
    return verdict("NaN log-probs at step 2 (step skipped)", code, read_rows(log_dir), [], compare=False)


DRILLS = {
    "sigkill": drill_kill,
    "sigkill-async": lambda o, m, r: drill_kill_async(o, m),
    "sigterm-rank": lambda o, m, r: drill_sigterm(o, m, r, whole_group=False),
    "sigterm-group": lambda o, m, r: drill_sigterm(o, m, r, whole_group=True),
    "gen-generate": lambda o, m, r: drill_generator(o, m, r, "generate:2", "generator killed during generation"),
    "gen-push": lambda o, m, r: drill_generator(o, m, r, "push:3", "generator killed during the weight push"),
    "gen-probe": lambda o, m, r: drill_generator(o, m, r, "probe:4", "generator killed during the parity probe"),
    "gen-restart": lambda o, m, r: drill_generator(o, m, r, "generate:2,start:2",
                                                   "generator killed during generation, then again during its restart",
                                                   expect="generator failed during its restart at step 2"),
    "server": lambda o, m, r: drill_server(o, m),
    "torn-metrics": drill_torn_metrics,
    "broken-metadata": drill_broken_metadata,
    "nan": lambda o, m, r: drill_nan(o, m),
}


def table(results) -> str:
    lines = ["| fault | recovered | steps lost | rows lost or duplicated | metrics equal to the uninterrupted run |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['fault']} | {'yes' if r['recovered'] else 'NO'} | {r['steps_lost']} | "
              f"{r['rows_lost_or_duplicated']} | {r['metrics_equal']} |" for r in results]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: a fresh tiny Qwen3)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", nargs="*", choices=sorted(DRILLS), help="run only these drills")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="fault-drill-")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    model = args.model
    if model is None:
        from megatron_grpo.models.tiny import make_tiny_model

        model = make_tiny_model(os.path.join(out, "tiny-model"), "qwen3")
    ref_dir = os.path.join(out, "uninterrupted")
    code, log = run([f"policy.model_name={model}"], ref_dir)
    if code != 0:
        print(log[-3000:])
        return 1
    reference = read_rows(ref_dir)
    results = []
    for name in args.only or list(DRILLS):
        results.append(DRILLS[name](out, model, reference))
        print(json.dumps(results[-1]), flush=True)
    print(table(results))
    ok = all(r["recovered"] and r["metrics_equal"] in ("yes", "n/a") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
