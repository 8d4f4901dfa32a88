"""TRL's GRPOTrainer on a local HF model and prompts file, timed per optimizer step (``tools/bench/bench_trl.py``).

Runs in the TRL venv that ``tools/bench/bench_trl.py`` makes (it imports neither this project nor its venv):

    VENV/bin/python tools/bench/trl_grpo_run.py --model DIR --prompts FILE --out OUT.json [--steps 22] [...]

Settings are the peer of ``megatron-grpo train``'s: fp32 on CPU, transformers' generation, every
completion exactly ``--max-new-tokens`` long (``min_new_tokens``: EOS is suppressed until then),
reward -len(completion), PPO clip eps, token-mean loss over the step's tokens (``dapo``), no KL
(beta 0), ``--micro-batch-size`` sequences per micro-batch and one optimizer step per generation
batch (gradient accumulation over the micro-batches), constant lr, AdamW (betas 0.9/0.999, eps 1e-8,
no weight decay), grad-norm clip 1. Gradient checkpointing off (GRPOConfig's default is on; off is
the same work as ours). Writes ``--out``: the wall clock (perf_counter) at each optimizer step's start
and end (``on_step_begin`` / ``on_step_end``: generation, forward-backward, optimizer) and TRL's per-step
logs (``num_tokens``, ``completions/mean_length``, ...) and the seconds of each generation (transformers'
``generate``; ``rollout``: with the rewards and advantages). With ``--baton`` it steps in turns with the
other trainers of the benchmark (``Baton``).
"""

from __future__ import annotations

import argparse
import json
import os
import time


class Baton:
    """Turns between trainers that run at the same time (``tools/bench/bench_trl.py``): a trainer steps only while
    ``DIR/turn`` names it, then hands the turn to the next of ``order`` that has not finished (``DIR/done-NAME``),
    so the trainers share the machine's background load step by step and never overlap; ``DIR/stop`` ends the
    waiting with an error (the benchmark stops). Stdlib only."""

    def __init__(self, folder: str, name: str, order, timeout_s: float = 3600.0):
        self.folder, self.name, self.order, self.timeout_s = folder, name, list(order), timeout_s

    def _read(self):
        try:
            with open(os.path.join(self.folder, "turn")) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def _write(self, name: str) -> None:
        tmp = os.path.join(self.folder, f"turn.{self.name}.tmp")
        with open(tmp, "w") as f:
            f.write(name)
        os.replace(tmp, os.path.join(self.folder, "turn"))

    def _finished(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.folder, f"done-{name}"))

    def _next(self, after: str) -> str:
        i = self.order.index(after)
        later = self.order[i + 1:] + self.order[:i + 1]
        return next((n for n in later if not self._finished(n)), after)

    def acquire(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if os.path.exists(os.path.join(self.folder, "stop")):
                raise RuntimeError(f"{self.name}: the benchmark stopped (another run failed)")
            turn = self._read()
            if turn is None or turn == self.name:
                return
            if self._finished(turn):  # its owner ended without handing it on
                self._write(self._next(turn))
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: waited {self.timeout_s:.0f} s for the turn held by {turn}")
            time.sleep(0.02)

    def release(self) -> None:
        self._write(self._next(self.name))

    def done(self) -> None:
        open(os.path.join(self.folder, f"done-{self.name}"), "w").close()
        if self._read() == self.name:
            self.release()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model folder (config, safetensors, tokenizer)")
    parser.add_argument("--prompts", required=True, help='JSONL of {"prompt": str}')
    parser.add_argument("--out", required=True, help="JSON with the step-end times and TRL's logs")
    parser.add_argument("--steps", type=int, default=22, help="optimizer steps")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=16, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="every completion's exact length")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward-backward")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eps", type=float, default=0.2, help="PPO clip epsilon (low = high)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; off here")
    parser.add_argument("--baton", default=None, metavar="DIR", help="step in turns with other trainers (Baton)")
    parser.add_argument("--name", default="trl", help="this trainer's name in the baton's order")
    parser.add_argument("--order", default="trl", help="comma-separated names taking turns")
    return parser.parse_args(argv)


def grpo_config_kwargs(args: argparse.Namespace, output_dir: str) -> dict:
    """``GRPOConfig`` keyword arguments for ``args`` (pure: no TRL import)."""
    sequences = args.prompts_per_step * args.num_generations
    if sequences % args.micro_batch_size:
        raise ValueError(f"{sequences} sequences per step are not a multiple of --micro-batch-size "
                         f"{args.micro_batch_size}")
    return dict(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, seed=args.seed, max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=sequences // args.micro_batch_size,
        num_generations=args.num_generations, max_completion_length=args.max_new_tokens,
        generation_kwargs={"min_new_tokens": args.max_new_tokens}, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, epsilon=args.eps, beta=0.0, num_iterations=1,
        loss_type="dapo", scale_rewards="group", gradient_checkpointing=args.gradient_checkpointing,
        model_init_kwargs={"dtype": "float32"}, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0, use_vllm=False,
    )


def negative_length(completions, completion_ids, **kwargs):
    """The reward: -len(completion) in tokens (ours: ``reward.name=negative_length``)."""
    return [-float(len(ids)) for ids in completion_ids]


def read_prompts(path: str) -> list:
    with open(path) as f:
        return [{"prompt": json.loads(line)["prompt"]} for line in f if line.strip()]


def timed_method(obj, name: str, seconds: list) -> None:
    """Appends the wall seconds of every call of ``obj.name`` to ``seconds``."""
    method = getattr(obj, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    setattr(obj, name, timed)


def main(argv=None) -> None:
    args = parse_args(argv)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    baton = Baton(args.baton, args.name, args.order.split(",")) if args.baton else None
    start, end, history = [], [], []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            if baton:
                baton.acquire()
            start.append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            end.append(time.perf_counter())
            if baton:
                baton.release()

        def on_log(self, _args, state, control, logs=None, **kw):
            history.append({"step": state.global_step, **(logs or {})})

    config = GRPOConfig(**grpo_config_kwargs(args, os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl-out")))
    trainer = GRPOTrainer(model=args.model, reward_funcs=negative_length, args=config,
                          train_dataset=Dataset.from_list(read_prompts(args.prompts)),
                          processing_class=AutoTokenizer.from_pretrained(args.model), callbacks=[StepTimes()])
    phases = {"generate": [], "rollout": []}  # generate: transformers' generate; rollout: + rewards, advantages
    timed_method(trainer, "_generate_single_turn", phases["generate"])
    timed_method(trainer, "_generate_and_score_completions", phases["rollout"])
    try:
        trainer.train()
    finally:
        if baton:
            baton.done()
    with open(args.out, "w") as f:
        json.dump({"step_start": start, "step_end": end, "logs": history, "phases": phases}, f)


if __name__ == "__main__":
    main()
