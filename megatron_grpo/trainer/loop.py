"""GRPO training loop: ``megatron-grpo train RECIPE.yaml [key=value ...]``.

prompts -> rollouts (n per prompt, generator at version j) -> rewards -> advantages ->
[reference log-probs] -> shadow forward + Megatron forward-backward + optimizer ->
deployed-improvement probe -> weight push + parity probe -> metrics.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import time
from typing import Dict, Optional

import torch

from megatron_grpo import faults
from megatron_grpo.checkpoint.resume import (
    export_last,
    find_resume_dir,
    finish_pending_save,
    load_checkpoint,
    save_checkpoint,
)
from megatron_grpo.config.precision import FP8
from megatron_grpo.config.schema import Config, to_dict, to_dtype
from megatron_grpo.loss import ADVANTAGE_ESTIMATORS, finalize
from megatron_grpo.observe.doctor import LiveDoctor
from megatron_grpo.observe.metrics_logger import to_host
from megatron_grpo.observe.summary import format_summary, write_summary
from megatron_grpo.parallel import comm
from megatron_grpo.rollout import Sampling
from megatron_grpo.rollout.parity import DEFAULT_MAX_TOLERANCE, DEFAULT_TOLERANCE, ParityError, ProbeBatch, check_parity
from megatron_grpo.rollout.staleness import StalenessGate
from megatron_grpo.rollout.transfer.delta import DeltaState
from megatron_grpo.rollout.transfer.weight_sync import PushReport, push_weights
from megatron_grpo.rollout.types import Collected, GeneratorError
from megatron_grpo.trainer import build as setup
from megatron_grpo.trainer import in_flight
from megatron_grpo.trainer.rewards import agreed_timeout_s, score_once
from megatron_grpo.trainer.step import build_step_batch, rollout_metrics

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run stopped by SIGTERM/SIGINT after its checkpoint (EX_TEMPFAIL: unfinished,
resume it); a scheduler can tell it from success (0) and from errors (1, 2)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run at the next step boundary, with a checkpoint."""


class GRPOTrainer:
    """Owns the model, optimizer, generator and logger of one run."""

    def __init__(self, cfg: Config):
        self._started = time.perf_counter()
        self.cfg = cfg
        self.ctx = setup.build_context(cfg)
        self.step, self.version, self.consecutive_skips = 0, 0, 0
        self.gate = StalenessGate(cfg.generation.max_staleness)
        self._pending = collections.deque()
        """Handles of generations submitted ahead, for steps step+1, step+2, ... (async)."""
        self._planned: Dict[int, tuple] = {}
        """(prompts, sampling) of each submitted step index until it trains (retries reuse them)."""
        self._stop_requested, self._last_push_names = False, []
        self.probe, self.parity_baseline = None, None
        g = cfg.generation
        self.delta = DeltaState(full_every=g.delta_full_every) if g.delta_push else None
        """This rank's delta-push state (``rollout/transfer/delta.py``), None with full pushes."""
        self._timing: Dict[str, float] = {}
        """Host seconds of this step's phases (``timing/<phase>_s``), measured with perf_counter."""
        resumed = self.maybe_resume()
        if not resumed and setup.engines_start_without_weights(cfg):
            self.push_weights(probe=False)  # FP8 engines start with placeholder weights: ours, before any rollout
        self.logger = setup.build_logger(cfg, self.ctx, start_step=self.step, resumed=resumed)
        self.doctor = LiveDoctor(to_dict(cfg))

    def maybe_resume(self) -> bool:
        """With ``checkpointing.resume``, restores the latest checkpoint and re-pushes its weights."""
        if not self.cfg.checkpointing.resume:
            return False
        path = find_resume_dir(self)
        if path is None:
            logger.info("checkpointing.resume: no checkpoint in %s, starting fresh", self.cfg.checkpointing.checkpoint_dir)
            return False
        load_checkpoint(self, path)
        self.push_weights(probe=False)
        return True

    def train(self) -> int:
        """Runs ``grpo.max_num_steps`` steps. SIGTERM/SIGINT (on any rank) stop the run at the next
        step boundary, agreed by every rank, with a checkpoint of the last finished step; returns
        0, or ``PREEMPTED_EXIT_CODE`` when stopped by a signal (the run is unfinished). The signal
        handlers are the caller's again on return (see ``restore_signal_handlers``)."""
        previous = self._install_signal_handlers()
        stopped, saved_at = "error", None
        try:
            self.check_parity(force=True)
            while not self.stop_requested() and self.step < self.cfg.grpo.max_num_steps:
                metrics = self.train_step()
                self.step += 1
                self.logger.log(self.step, metrics)
                self.report_findings(metrics)
                self.check_skips(metrics)
                if self.checkpoint_due():
                    self.save()
                    saved_at = self.step
                faults.maybe_kill(self.step)
            if self.cfg.checkpointing.checkpoint_dir and self.step and saved_at != self.step:
                self.save()  # the final step, or the step a signal stopped at (every rank agreed)
            # preempted: the agreed stop came before the last step (a later, local signal changes nothing)
            stopped = "signal" if self._stop_requested and self.step < self.cfg.grpo.max_num_steps else None
            self.finish_checkpoints(export=stopped is None)
        finally:
            self.close()
            self.finish(stopped)
            restore_signal_handlers(previous)
        return PREEMPTED_EXIT_CODE if stopped == "signal" else 0

    def report_findings(self, metrics: Dict[str, float]) -> None:
        """The doctor's checks, live on rank 0: each finding printed once, when it first triggers."""
        if self.ctx.rank != 0:
            return
        for message in self.doctor.update(self.step, metrics):
            self.logger.write(message)

    def finish(self, stopped: Optional[str]) -> None:
        """Rank 0: the end-of-run summary from metrics.jsonl, printed and written to summary.json.
        Never raises (a failure here must not hide the run's own error)."""
        if self.ctx.rank != 0:
            return
        try:
            summary = write_summary(self.cfg.logger.log_dir, to_dict(self.cfg), planned_steps=self.cfg.grpo.max_num_steps,
                                    wall_s=time.perf_counter() - self._started, stopped=stopped)
            print(format_summary(summary), flush=True)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not write the run summary: %s", exc)

    def checkpoint_due(self) -> bool:
        """A periodic save is due: depends on the step only, identical on every rank (a stop request
        is acted on after the loop, once every rank has agreed on it)."""
        period = self.cfg.checkpointing.save_period
        return bool(self.cfg.checkpointing.checkpoint_dir) and period > 0 and self.step % period == 0

    def save(self) -> str:
        return save_checkpoint(self)

    def finish_checkpoints(self, export: bool) -> None:
        """Waits for an asynchronous checkpoint to be finalized; then, on a finished run with
        ``checkpointing.export_hf``, exports the last checkpoint as a Hugging Face model."""
        finish_pending_save()
        if export and self.cfg.checkpointing.export_hf:
            export_last(self)

    def _install_signal_handlers(self) -> Dict[int, object]:
        """SIGTERM/SIGINT request a stop at the next step boundary; returns the handlers they replace."""
        def request_stop(signum, frame):
            logger.warning("signal %d: saving a checkpoint at the end of this step, then exiting", signum)
            self._stop_requested = True

        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            signal.signal(sig, request_stop)
        return previous

    def stop_requested(self) -> bool:
        """True on every rank when any rank got SIGTERM/SIGINT (agreed at the step boundary)."""
        flag = torch.tensor(float(self._stop_requested), device=comm.collective_device(self.ctx.device))
        self._stop_requested = bool(comm.all_reduce_max(flag, comm.world_group()).item())
        return self._stop_requested

    def check_skips(self, metrics: Dict[str, float]) -> None:
        """Counts consecutive skipped (non-finite) steps; too many stop the run naming the culprit."""
        if not metrics.get("train/skipped_nonfinite"):
            self.consecutive_skips = 0
            return
        self.consecutive_skips += 1
        culprit = "; ".join(self.ctx.stepper.nonfinite) or "gradients (non-finite grad norm)"
        logger.warning("step %d skipped: %s", self.step, culprit)
        if self.consecutive_skips >= self.cfg.grpo.max_consecutive_skips:
            raise RuntimeError(f"{self.consecutive_skips} consecutive steps skipped for non-finite values; "
                               f"step {self.step}: {culprit}")

    def train_step(self) -> Dict[str, float]:
        started = time.perf_counter()
        rollouts = self.next_rollouts()
        if self.ctx.engine is not None:
            self.ctx.engine.sleep()  # colocated on GPU: the engines free the device for the trainer step
        t_gen = time.perf_counter() - started
        rewards = self.score(rollouts)
        t_reward = time.perf_counter() - started - t_gen
        advantages = ADVANTAGE_ESTIMATORS.get(self.cfg.grpo.advantage_estimator)(
            rewards, self.cfg.grpo.num_generations_per_prompt)
        batch = build_step_batch(rollouts, advantages, self.ctx.dp_rank, self.ctx.dp_size, self.ctx.pad_id,
                                 step=self.step + 1, balance_tokens=self.ctx.stepper.plan_spec.balances_tokens)
        t_train = time.perf_counter()
        stats, extra = self.ctx.stepper.run(batch, self.step + 1)
        t_train = time.perf_counter() - t_train
        if self.step + 1 in self.cfg.logger.token_dump_steps and self.ctx.rank == 0:
            self.dump_tokens(batch)
        self.version += 1
        sync = self.push_weights()
        device = self.ctx.device  # every metric tensor lives there until the one host sync
        metrics = finalize(*stats.reduce(self.ctx.dp_group))
        metrics.update(extra)
        metrics.update(rollout_metrics(rollouts, rewards, device))
        metrics.update(sync)
        host = {"rollout/dropped_stale": float(self.gate.dropped), "time/generate_s": t_gen,
                "rollout/policy_version_lag": float(self.version - 1 - min(r.policy_version for r in rollouts)),
                "time/step_s": time.perf_counter() - started, "timing/generate_s": t_gen,
                "timing/reward_s": t_reward, "timing/train_s": t_train, **self._timing}
        metrics.update({k: torch.tensor(v, device=device) for k, v in host.items()})
        return to_host(metrics)

    def dump_tokens(self, batch) -> None:
        """Writes this rank's valid tokens (rollout, trainer, shadow log-probs; advantage) for plots."""
        train_lp, shadow = (t.cpu() for t in self.ctx.stepper.last_log_probs)
        mask = batch.packed.mask
        adv = batch.advantages.unsqueeze(-1).expand_as(mask)
        data = {"step": self.step + 1, "old_log_probs": batch.old_log_probs[mask].tolist(),
                "log_probs": train_lp[mask].tolist(), "shadow_log_probs": shadow[mask].tolist(),
                "advantages": adv[mask].tolist(), "ratio_clip_min": self.cfg.loss_fn.ratio_clip_min,
                "ratio_clip_max": self.cfg.loss_fn.ratio_clip_max}
        os.makedirs(self.cfg.logger.log_dir, exist_ok=True)
        with open(os.path.join(self.cfg.logger.log_dir, f"tokens_step{self.step + 1}.json"), "w") as f:
            json.dump(data, f)

    # ---- rollouts -----------------------------------------------------------------------------------------

    def next_rollouts(self):
        """Rollouts for this step from the generator (rank 0), broadcast to every rank.

        With ``generation.max_staleness = k >= 1`` the generations of the next k steps are
        submitted before this step trains, so step s trains on rollouts of weights version
        s - k (the generator works through them while the trainer trains); rollouts older than
        ``max_staleness`` versions are dropped, counted and regenerated.
        """
        failures = 0
        while True:
            result = None
            if self.ctx.engine is not None:
                try:
                    result = ("ok", self._collect_fresh())
                except GeneratorError as exc:
                    result = ("failed", str(exc))
                else:
                    try:
                        self._submit_ahead()
                    except GeneratorError as exc:  # keep this step's rollouts; the next step restarts the engine
                        logger.warning("submitting ahead failed (%s); regenerating at the next step",
                                       str(exc).splitlines()[0])
                        self._pending.clear()  # their prompts and seeds stay planned
            status, value = comm.broadcast_object(result, src=0)
            if status == "ok":
                return value
            failures = self._recover_generator(failures, "generation", value)

    def restart_generator(self, push: bool = True) -> Optional[str]:
        """Rebuilds the dead or failed engines of the pool on rank 0 (the others keep their state) and
        (unless the caller pushes itself) pushes the current weights to them (collective). Returns
        None, or the error of an engine that died again while starting (agreed by every rank; no push
        then): the caller counts it as one more failure and restarts again."""
        self._pending.clear()
        if self.delta is not None:  # every rank: a restarted engine holds no base for patches
            self.delta.force_full = True
        failure = None
        restart = getattr(self.ctx.engine, "restart_failed", None)  # the megatron backend has no process
        if restart is not None:
            try:
                restart()
            except GeneratorError as exc:
                failure = str(exc)
        failure = comm.broadcast_object(failure, src=0)
        if failure is None and push:
            self.push_weights(probe=False)
        return failure

    def _collect_fresh(self):
        faults.maybe_kill_generator(self.step + 1, self.ctx.engine)
        while True:
            handle = self._pending.popleft() if self._pending else self._submit(self.step)
            rollouts = handle.rollouts if isinstance(handle, Collected) else self.ctx.engine.collect(handle)
            oldest = min(r.policy_version for r in rollouts)  # engines of a pool may differ after a restart
            if self.gate.accept(oldest, self.version, len(rollouts)):
                self._planned = {k: v for k, v in self._planned.items() if k > self.step}
                return rollouts

    def _submit_ahead(self) -> None:
        """Keeps ``max_staleness`` generations in flight, for steps step+1 ... step+k."""
        depth = self.cfg.generation.max_staleness
        while len(self._pending) < depth:
            step = self.step + 1 + len(self._pending)
            if step >= self.cfg.grpo.max_num_steps:
                return
            self._pending.append(self._submit(step))

    def in_flight_state(self) -> list:
        """Rank 0, at a save: the generations in flight, collected, as plain data (``trainer/in_flight.py``)."""
        self._pending, saved = in_flight.collect(self._pending, self._planned, self.ctx.engine, self.step)
        return saved

    def restore_in_flight(self, saved: Optional[list]) -> None:
        """Requeues a checkpoint's generations in flight (``trainer/in_flight.py``)."""
        g = self.cfg.generation
        restored = in_flight.restore(saved, g.max_staleness, Sampling(temperature=g.temperature, top_p=g.top_p,
                                                                      top_k=g.top_k))
        if restored is not None:
            self._pending, self._planned = restored

    def _submit(self, step: int):
        """Submits the generation of step index ``step`` (0-based). Its prompts and seeds are drawn
        once and kept until the step trains: a retry after a generator crash, or a regeneration of
        stale rollouts, asks for the very same prompts and seeds (no prompt is skipped)."""
        if step not in self._planned:
            g = self.cfg.generation
            prompts = self.ctx.sampler.next(self.cfg.grpo.num_prompts_per_step)
            self._planned[step] = (prompts, Sampling(
                max_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                seed=self.cfg.grpo.seed * 1_000_003 + step * 10_007, stop_token_ids=(self.ctx.eos_id,),
                ignore_eos=g.ignore_eos))
        prompts, sampling = self._planned[step]
        return self.ctx.engine.submit_generate(prompts, self.cfg.grpo.num_generations_per_prompt, sampling)

    def score(self, rollouts) -> torch.Tensor:
        """Rewards scored once on rank 0 and broadcast (every rank gets the same values or error)."""
        timeout_s = agreed_timeout_s(self.cfg.reward.timeout_s, self.cfg.cluster.distributed_timeout_minutes,
                                     comm.group_size(comm.world_group()))
        return score_once(self.ctx.reward_fn, self.cfg.reward.name, self.step + 1,
                          [r.completion_ids for r in rollouts], self.ctx.decode, [r.prompt_ids for r in rollouts],
                          timeout_s=timeout_s, rank=self.ctx.rank)

    # ---- weights --------------------------------------------------------------------------------------------

    def push_weights(self, probe: bool = True) -> Dict[str, torch.Tensor]:
        """Pushes the new weights to the generator and runs the parity probe when due. A generator
        that dies during the push is restarted and pushed to again (agreed by every rank, since
        the push's gathers are collective), at most ``generation.max_restarts`` times."""
        started = time.perf_counter()
        wake_engines(self.ctx.engine, self.cfg.generation.colocated)
        failures = 0
        while True:
            faults.maybe_kill_generator(self.step + 1, self.ctx.engine, "push")
            failure = None
            try:
                report = self._push_once()
            except GeneratorError as exc:  # only rank 0 holds the engine
                failure = str(exc)
            failure = comm.broadcast_object(failure, src=0)
            if failure is None:
                break
            failures = self._recover_generator(failures, "the weight push", failure, push=False)
        self._last_push_names = report.names
        out = {"sync/push_s": torch.tensor(report.seconds, device=self.ctx.device),
               "sync/push_bytes": torch.tensor(float(report.num_bytes), device=self.ctx.device),
               "sync/delta_fraction": torch.tensor(report.num_bytes / max(report.dense_bytes, 1), device=self.ctx.device)}
        self._timing = {"timing/weight_push_s": time.perf_counter() - started, "timing/parity_s": 0.0}
        if probe:
            started = time.perf_counter()
            out.update(self.check_parity())
            self._timing["timing/parity_s"] = time.perf_counter() - started
        return out

    def _push_once(self):
        """One push of the current weights (collective: every rank gathers). An engine that shares
        the trainer's weights (``megatron``, on every rank) only records the version: nothing moves."""
        if getattr(self.ctx.engine, "shares_trainer_weights", False):
            self.ctx.engine.update_weights((), self.version)
            return PushReport(version=self.version)
        p = self.cfg.policy.precision
        return push_weights(self.ctx.model, self.ctx.shape, self.ctx.engine, self.version,
                            dtype=to_dtype(p.generation_dtype), bucket_mb=self.cfg.generation.weight_push_bucket_mb,
                            delta=self.delta, fp8=p.fp8.recipe() if p.generation_dtype == FP8 else None)

    def _recover_generator(self, failures: int, during: str, error: str, push: bool = True) -> int:
        """After a generator crash (every rank agrees; ``failures`` earlier ones in this phase of the
        step): restart it, or stop once ``generation.max_restarts`` restarts did not help. A restart
        whose engine dies while starting is one more failure of the same budget, restarted the same
        way. Returns the failures counted so far."""
        while True:
            if failures >= self.cfg.generation.max_restarts:
                raise GeneratorError(f"generator failed {failures + 1} times during {during} at step "
                                     f"{self.step + 1}; last error: {error}")
            logger.warning("generator failed during %s at step %d (%s); restarting it", during, self.step + 1,
                           error.splitlines()[0] if error else "")
            failures += 1
            error = self.restart_generator(push=push)
            if error is None:
                return failures
            during = "its restart"

    def check_parity(self, force: bool = False) -> Dict[str, torch.Tensor]:
        """Parity probe (generator vs trainer log-probs on the fixed probe set, temperature 1); the
        first one records the baseline the later ones are compared with. A generator that dies
        during the probe is restarted (weights re-pushed) and probed again."""
        g = self.cfg.generation
        if g.parity_probe_every == 0 or (not force and self.version % g.parity_probe_every):
            return {}
        failures = 0
        while True:
            status, value = self._probe_once()
            if status != "generator":
                break
            failures = self._recover_generator(failures, "the parity probe", value)
        if status == "parity":
            raise ParityError(value)
        if self.parity_baseline is None:
            self.parity_baseline = dict(value)
        return {k: torch.tensor(v, device=self.ctx.device) for k, v in value.items()}

    def _probe_once(self):
        """``(status, value)`` agreed by every rank: ("ok", metrics), ("parity", message) or
        ("generator", error) when the generator died."""
        g = self.cfg.generation
        gen_dtype = to_dtype(self.cfg.policy.precision.generation_dtype)
        tol = g.parity_tolerance or DEFAULT_TOLERANCE[gen_dtype]
        max_tol = g.parity_max_tolerance or DEFAULT_MAX_TOLERANCE[gen_dtype]
        scores, probe = self.ctx.trainer_scores(gen_dtype), self.parity_probe()
        result = None
        if self.ctx.engine is not None:
            faults.maybe_kill_generator(self.step + 1, self.ctx.engine, "probe")
            try:
                result = ("ok", check_parity(self.ctx.engine, probe, scores, self._last_push_names, tol, self.version,
                                             max_tolerance=max_tol, baseline=self.parity_baseline,
                                             growth=g.parity_growth, checksums=self._checksums_due()))
            except ParityError as exc:
                result = ("parity", str(exc))
            except GeneratorError as exc:
                result = ("generator", str(exc))
        else:
            scores(probe)  # the trainer forward is collective over TP
        return comm.broadcast_object(result, src=0)

    def _checksums_due(self) -> bool:
        """vLLM's weight checksums on the first probe and every ``generation.weight_checksum_every``-th after."""
        g = self.cfg.generation
        every = g.weight_checksum_every * max(g.parity_probe_every, 1)
        return self.parity_baseline is None or (every > 0 and self.version % every == 0)

    def parity_probe(self):
        """The probe set, sampled once from the generator at the start (realistic sequences from
        the first prompts; temperature 1, fixed seed) and broadcast; synthetic tokens if every
        sampled completion is empty."""
        if self.probe is None:
            probe = None
            if self.ctx.engine is not None:
                prompts = self.ctx.sampler.prompts[:4]
                probe = ProbeBatch.sampled(self.ctx.engine, prompts, self.cfg.generation.max_new_tokens,
                                           seed=self.cfg.grpo.seed + 7919, stop_token_ids=(self.ctx.eos_id,))
                probe = probe or self.ctx.probe
            self.probe = comm.broadcast_object(probe, src=0)
        return self.probe

    def close(self) -> None:
        self.logger.close()
        if self.ctx.engine is not None:
            self.ctx.engine.close()


def restore_signal_handlers(previous: Dict[int, object]) -> None:
    """Puts back the handlers ``GRPOTrainer._install_signal_handlers`` replaced. Its handler is a
    closure over the trainer: left installed, it keeps the trainer (model, optimizer, and the process
    groups they hold) alive until the interpreter exits, past ``state.shutdown``."""
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def wake_engines(engine, colocated: bool) -> None:
    """Before a push: every rank returns its cached GPU blocks (colocated engine e wakes on the GPUs
    of trainer ranks e*TP ..., not only rank 0's), colocated ranks agree they have, then rank 0 (the
    one holding ``engine``) wakes the engines from the trainer step's sleep."""
    release_device_cache()
    if colocated:
        comm.barrier(comm.world_group())
    if engine is not None:
        engine.wake_up()


def release_device_cache() -> None:
    """GPU: returns the caching allocator's free blocks to the driver (a colocated vLLM engine, another
    process, can only wake into memory the trainer's allocator does not hold); CPU: nothing."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
