"""A pool of generator engines behind the one ``RolloutEngine`` interface the trainer uses.

- Generation: the prompts are split into contiguous shards, one per engine, submitted to every
  engine at once; completions come back in prompt order. Completion i of (global) prompt p
  uses seed + p * n + i on whichever engine it lands, so the rollouts do not depend on the
  number of engines (an engine's shard starting at prompt s gets base seed seed + s * n).
- Versions: each engine carries the version of the weights it last loaded, and each rollout
  the version of the engine that made it; the trainer's staleness gate reads the oldest.
- Weights: one gather, fan-out push: each bucket is published once (``fanout.fan_out``, files)
  or handed to every engine's own stream (``fanout.fan_out_streams``, vLLM's weight-transfer
  API), and every engine loads it concurrently. A push goes to the engines that are not at the target
  version yet (after a restart: only the restarted ones), or to all when all already are.
- Faults: an engine that fails is named in the error (``engine i of N``) and remembered;
  ``restart_failed`` rebuilds only the dead or failed engines while the others keep their
  weights, and the next push brings the new ones up to date. An engine that dies again while it
  restarts is named (``failed to start``) and stays failed: the next ``restart_failed`` retries it.
- Colocated engines (``generation.colocated``) sleep during the trainer step on GPU
  (``sleep``/``wake_up``, vLLM ``sleep(level=1)``); on CPU both are no-ops.

Placement (pure arithmetic, printed by ``train --dry-run``): ``engine_placement``.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from megatron_grpo.rollout.transfer.fanout import fan_out, fan_out_streams
from megatron_grpo.rollout.transfer.stage_push import StageFiles, StagePlan, plan_push
from megatron_grpo.rollout.types import GeneratorError, RolloutEngine, Rollouts, Sampling

logger = logging.getLogger(__name__)


def shard_bounds(num_items: int, num_shards: int) -> List[Tuple[int, int]]:
    """Contiguous [start, stop) ranges of ``num_items`` over ``num_shards`` (sizes differ by at most 1)."""
    base, extra = divmod(num_items, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


# ---- placement ----------------------------------------------------------------------------------------------


@dataclass
class EngineSlot:
    """Where engine ``index`` runs. Rank 0 always drives it (spawns it or connects to it)."""

    index: int
    ranks: List[int]
    """Colocated: the trainer ranks whose devices it shares; dedicated: empty."""
    devices: Optional[List[int]]
    """GPU ids on rank 0's node (CUDA_VISIBLE_DEVICES of its process); None for a running server."""
    url: Optional[str] = None
    """A running server (``generation.server_urls``)."""

    def where(self) -> str:
        if self.url:
            return f"server {self.url} (dedicated)"
        gpus = ",".join(str(d) for d in self.devices or [])
        if self.ranks:
            ranks = ",".join(str(r) for r in self.ranks)
            return f"shares the devices of rank{'s' if len(self.ranks) > 1 else ''} {ranks} (GPU {gpus})"
        return f"dedicated local GPU {gpus} (after the trainer's)"


def engine_placement(g, world_size: int, local_world_size: Optional[int] = None,
                     num_local_gpus: Optional[int] = None) -> List[EngineSlot]:
    """Engine e's slot. Rank 0 spawns every local engine, so they all live on rank 0's node, whose
    trainer ranks are ``local_world_size`` (torchrun's LOCAL_WORLD_SIZE) of the ``world_size``:
    colocated engine e shares the devices of local ranks e*TP ... e*TP+TP-1; dedicated engines take
    the node's GPUs after the trainer's; servers are ``g.urls``. ``num_local_gpus``: the GPUs rank 0's
    node has (None on CPU, where engines that outnumber the ranks just share the cores); on GPU an
    engine that would not fit is a ``ValueError``, never a silent wrap onto the trainer's GPUs. A trainer
    rank's GPU is LOCAL_RANK % the visible GPUs (``parallel.state.init_distributed``, Megatron-LM's rule),
    so the trainer's are the first min(local ranks, visible GPUs) of them."""
    tp, local = g.tensor_parallel_size, local_world_size or world_size
    need = g.num_engines * tp
    if not g.urls and num_local_gpus is not None:
        _check_fit(g, need, local, num_local_gpus)
    gpus = num_local_gpus or local
    slots = []
    for e in range(g.num_engines):
        ranks = [(e * tp + k) % local for k in range(tp)]
        if g.urls:
            slots.append(EngineSlot(e, [], None, g.urls[e]))
        elif g.colocated:
            slots.append(EngineSlot(e, sorted(set(ranks)), [r % gpus for r in ranks]))
        else:
            slots.append(EngineSlot(e, [], [min(local, gpus) + e * tp + k for k in range(tp)]))
    return slots


def _check_fit(g, need: int, local: int, num_local_gpus: int) -> None:
    what = (f"generation.num_engines={g.num_engines} x generation.tensor_parallel_size={g.tensor_parallel_size} = "
            f"{need} GPUs")
    if g.colocated and need > local:
        raise ValueError(f"{what} for colocated engines, but rank 0's node runs {local} trainer rank(s) "
                         f"(LOCAL_WORLD_SIZE): rank 0 spawns every engine on its own node. Lower generation.num_engines "
                         "or tensor_parallel_size, or run engines on other nodes (generation.server_urls)")
    if g.colocated and need > num_local_gpus:
        raise ValueError(f"{what} for colocated engines on the GPUs of local ranks 0..{need - 1}, but rank 0 sees "
                         f"{num_local_gpus} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
                         "; one GPU per task as under srun --gpus-per-task=1?) and spawns every engine: make the node's "
                         "GPUs visible to each rank (srun --gpus-per-node), or lower generation.num_engines or "
                         "tensor_parallel_size")
    trainer_gpus = min(local, num_local_gpus)
    if not g.colocated and trainer_gpus + need > num_local_gpus:
        raise ValueError(f"{what} for dedicated engines after the trainer's {trainer_gpus} on rank 0's node, which has "
                         f"{num_local_gpus}: free GPUs there (fewer trainer ranks per node), set generation.colocated="
                         "true, or run engines on other nodes (generation.server_urls)")


def format_placement(g, world_size: int, local_world_size: Optional[int] = None) -> str:
    """The dry run's text: which rank owns which engine, and on which devices."""
    if g.backend == "megatron":
        return (f"generator: the trainer's own model (generation.backend=megatron) on all {world_size} rank(s); "
                "no separate engines, no weight push")
    slots = engine_placement(g, world_size, local_world_size)
    mode = ("colocated (sleep during the trainer step on GPU; a no-op on CPU)" if g.colocated else "dedicated")
    lines = [f"generator: {g.num_engines} x {g.backend} engine(s), tensor_parallel_size={g.tensor_parallel_size}, "
             f"{mode}; rank 0 drives every engine (spawns or connects, pushes weights once to all)"]
    lines += [f"  engine {s.index}: {s.where()}" for s in slots]
    if g.colocated and g.num_engines * g.tensor_parallel_size > (local_world_size or world_size):
        lines.append(f"  note: {g.num_engines} engines x TP {g.tensor_parallel_size} > {local_world_size or world_size} "
                     "rank(s) on rank 0's node: on CPU the engines split the cores (on GPU this is an error)")
    return "\n".join(lines)


def check_engine_shape(g, shape, fp8_block: Optional[Sequence[int]] = None) -> None:
    """vLLM splits attention heads over its TP workers: ``ValueError`` naming the key when they do not divide.
    FP8 engines (``fp8_block``: ``policy.precision.fp8.weight_block_size``): every linear's TP partition must
    hold whole blocks (vLLM's ``validate_fp8_block_shape`` refuses the engine otherwise; its MoE experts adapt
    their blocks to the partition themselves)."""
    tp = g.tensor_parallel_size
    if shape.num_heads % tp:
        raise ValueError(f"generation.tensor_parallel_size={tp} does not divide the model's {shape.num_heads} "
                         "attention heads (vLLM shards heads over its TP workers)")
    if fp8_block is None:
        return
    bn, bk = fp8_block
    for what, size in _fp8_engine_partitions(shape, tp).items():
        block = bk if what.endswith("columns") else bn
        if size % block:
            raise ValueError(f"policy.precision.fp8.weight_block_size={list(fp8_block)}: vLLM's FP8 engine at "
                             f"generation.tensor_parallel_size={tp} holds {size} {what} per worker, not a multiple "
                             f"of {block} (vLLM refuses the engine); change the block or the engine's TP")


def _fp8_engine_partitions(shape, tp: int) -> Dict[str, int]:
    """What one of vLLM's TP workers holds of each FP8 linear that its block FP8 checks (rows of column-parallel
    and fused linears, columns of row-parallel ones): q / k / v (k / v replicated below one KV head per worker)
    and o, or multi-latent attention's q_b_proj (q_proj), kv_b_proj and o_proj (its fused q_a_proj +
    kv_a_proj_with_mqa is replicated: q_a_proj's rows, the merged part it checks); dense MLPs (DeepSeek's first
    layers too) and shared experts. Routed experts adapt their blocks to the partition themselves."""
    heads, d = shape.num_heads // tp, shape.head_dim
    if shape.is_mla:
        sizes = {("q_b_proj" if shape.q_lora_rank else "q_proj") + " rows": heads * d,
                 "kv_b_proj rows": heads * (shape.qk_nope_head_dim + shape.v_head_dim),
                 "o_proj columns": heads * shape.v_head_dim}
        if shape.q_lora_rank:
            sizes["fused_qkv_a_proj's q_a_proj rows"] = shape.q_lora_rank
    else:
        sizes = {"q_proj rows": heads * d, "k_proj / v_proj rows": max(shape.num_kv_heads // tp, 1) * d,
                 "o_proj columns": heads * d}
    mlps = {"": shape.ffn_hidden_size} if not shape.is_moe or shape.first_dense_layers else {}
    if shape.shared_expert_ffn_hidden_size:
        mlps["shared_experts' "] = shape.shared_expert_ffn_hidden_size
    for where, ffn in mlps.items():
        sizes.update({f"{where}gate_proj / up_proj rows": ffn // tp, f"{where}down_proj columns": ffn // tp})
    return sizes


def cpu_bindings(num_engines: int, tp: int, cpus: Sequence[int]) -> List[Optional[str]]:
    """vLLM ``VLLM_CPU_OMP_THREADS_BIND`` per engine: the cores split evenly over every engine's TP
    workers ("0|1" = worker 0 on core 0, worker 1 on core 1); a single TP=1 engine keeps vLLM's
    automatic binding (None). With fewer cores than workers, workers share cores round-robin."""
    slots = num_engines * tp
    if slots == 1:
        return [None]
    cpus = sorted(cpus)
    if len(cpus) >= slots:
        groups = [[cpus[i] for i in range(a, b)] for a, b in shard_bounds(len(cpus), slots)]
    else:
        groups = [[cpus[k % len(cpus)]] for k in range(slots)]
    return ["|".join(",".join(str(c) for c in groups[e * tp + k]) for k in range(tp)) for e in range(num_engines)]


def available_cpus() -> List[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


# ---- the pool -----------------------------------------------------------------------------------------------


class EnginePool(RolloutEngine):
    """``num_engines`` engines built by ``factory(i)`` (concurrently), used as one engine."""

    def __init__(self, factory: Callable[[int], RolloutEngine], num_engines: int, *, sleep_between_steps: bool = False):
        self.factory, self.sleep_between_steps = factory, sleep_between_steps
        self._executor = ThreadPoolExecutor(max_workers=max(2, num_engines), thread_name_prefix="engine-pool")
        self.engines: List[RolloutEngine] = [None] * num_engines
        self._failed: Set[int] = set()
        self._needs_push: Set[int] = set()
        self._asleep = False
        self._build(range(num_engines))

    # ---- building, restarting, closing --------------------------------------------------------------------

    def _build(self, indices: Iterable[int], keep_started: bool = False) -> None:
        """Builds engines ``indices`` concurrently. On a failure closes those built (``keep_started``: keeps
        them; the ones that failed stay None and are remembered as failed) and raises the first error,
        naming the engine (a ``GeneratorError`` carries its ``engine_index``)."""
        indices = list(indices)
        futures = {i: self._executor.submit(self.factory, i) for i in indices}
        errors = []
        for i, fut in futures.items():
            try:
                self.engines[i] = fut.result()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append((i, exc))
        if errors:
            for i in indices:
                if self.engines[i] is not None and not keep_started:
                    self._close_one(i)
            self._failed |= {i for i, _ in errors}
            i, exc = errors[0]
            if isinstance(exc, RuntimeError):
                err = type(exc)(f"engine {i} of {len(self.engines)} failed to start: {exc}")
                err.engine_index = i
                raise err from exc
            raise exc

    @property
    def accepts_delta_push(self) -> bool:
        """Every engine applies delta patches (a pool pushes the same buckets to all)."""
        return all(getattr(e, "accepts_delta_push", False) for e in self.engines if e is not None)

    def restart_failed(self) -> List[int]:
        """Rebuilds the engines that died or failed (all of them if none is known to have); the
        others keep their state. The restarted ones get the next weight push. Returns their indices.
        An engine that fails to start again (dies while starting) raises a ``GeneratorError`` naming
        it; it stays failed (the caller counts one more failure and calls this again), while the
        engines that did start are kept."""
        indices = sorted(self._failed | {i for i, e in enumerate(self.engines) if not _alive(e)})
        indices = indices or list(range(len(self.engines)))
        logger.warning("restarting generator engine(s) %s of %d", ", ".join(map(str, indices)), len(self.engines))
        for i in indices:
            self._close_one(i)
        self._needs_push |= set(indices)
        self._failed -= set(indices)
        self._build(indices, keep_started=True)
        return indices

    def _close_one(self, i: int) -> None:
        engine, self.engines[i] = self.engines[i], None
        try:
            if engine is not None:
                engine.close()
        except Exception:  # noqa: BLE001 - it may already be broken
            pass

    def close(self, concurrently: bool = True) -> None:
        if not getattr(self, "engines", None):
            return
        if concurrently:
            list(self._executor.map(self._close_one, range(len(self.engines))))
        else:
            for i in range(len(self.engines)):
                self._close_one(i)
        self.engines = []
        self._executor.shutdown(wait=False)

    def __del__(self):
        # never wait on the thread pool from a finalizer: the garbage collector may run it while this
        # thread holds a lock (an import's, measured) that the pool's threads then wait for
        try:
            self.close(concurrently=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- identity and health ------------------------------------------------------------------------------

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def dtype(self) -> torch.dtype:
        return self.engines[0].dtype

    @property
    def policy_version(self) -> int:
        """The oldest weights version among the engines."""
        return min(self.versions())

    def versions(self) -> List[int]:
        """Each engine's weights version."""
        return [e.policy_version for e in self.engines]

    def name(self, i: int) -> str:
        engine = self.engines[i] if i < len(self.engines) else None
        describe = getattr(engine, "describe", None)
        return f"engine {i} of {len(self.engines)}" + (f" ({describe()})" if describe is not None else "")

    def alive(self) -> bool:
        return all(_alive(e) for e in self.engines)

    def kill_process(self) -> None:
        """Fault drills: kills one engine (the last) abruptly; the others keep running."""
        self.engines[-1].kill_process()

    def _run(self, i: int, fn: Callable[[RolloutEngine], object]):
        """``fn(engine i)``; a failure is remembered (for ``restart_failed``) and re-raised naming the engine."""
        try:
            return fn(self.engines[i])
        except GeneratorError as exc:
            self._failed.add(i)
            err = GeneratorError(f"{self.name(i)}: {exc}")
            err.engine_index = i
            raise err from exc

    def _map(self, fn: Callable[[int], object], indices: Sequence[int]) -> list:
        """``[fn(i) for i in indices]`` concurrently; every call finishes before the first error is raised."""
        futures = [self._executor.submit(fn, i) for i in indices]
        results, first = [], None
        for fut in futures:
            try:
                results.append(fut.result())
            except BaseException as exc:  # noqa: BLE001
                first = first or exc
                results.append(None)
        if first is not None:
            raise first
        return results

    # ---- generation and scoring ---------------------------------------------------------------------------

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Sampling) -> Rollouts:
        return self.collect(self.submit_generate(prompt_token_ids, n, sampling))

    def submit_generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Sampling):
        """Submits each engine's shard (concurrently: a server's submit blocks until done)."""
        prompts = [list(p) for p in prompt_token_ids]
        shards = [(i, a, b) for i, (a, b) in enumerate(shard_bounds(len(prompts), len(self.engines))) if b > a]

        def submit(k: int):
            i, start, stop = shards[k]
            shard = replace(sampling, seed=None if sampling.seed is None else sampling.seed + start * n)
            return self._run(i, lambda e: e.submit_generate(prompts[start:stop], n, shard))

        handles = self._map(submit, range(len(shards)))
        return [(i, start, self.engines[i], h) for (i, start, _), h in zip(shards, handles)]

    def collect(self, handle) -> Rollouts:
        """Each shard's rollouts, in prompt order, prompt indices global; each carries its engine's version."""
        items = []
        for i, start, engine, sub in handle:
            if self.engines[i] is not engine:
                raise GeneratorError(f"{self.name(i)} was restarted after this generation was submitted")
            for r in self._run(i, lambda e: e.collect(sub)):
                r.prompt_index += start
                items.append(r)
        return Rollouts(items)

    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> List[List[float]]:
        """Sharded over the engines like generation."""
        shards = [(i, a, b) for i, (a, b) in enumerate(shard_bounds(len(sequences), len(self.engines))) if b > a]
        parts = self._map(lambda k: self._run(shards[k][0], lambda e: e.score(
            sequences[shards[k][1]:shards[k][2]], prompt_lens[shards[k][1]:shards[k][2]])), range(len(shards)))
        return [row for part in parts for row in part]

    def score_replicas(self, sequences, prompt_lens) -> List[Tuple[str, List[List[float]]]]:
        """Every engine scores the same sequences (concurrently): the parity probe checks each one."""
        scores = self._map(lambda i: self._run(i, lambda e: e.score(sequences, prompt_lens)),
                           range(len(self.engines)))
        return [(self.name(i), s) for i, s in enumerate(scores)]

    # ---- weights ------------------------------------------------------------------------------------------

    def push_targets(self, version: int) -> List[int]:
        """The engines the push of ``version`` goes to: those behind it (all of them when none is)."""
        targets = [i for i, e in enumerate(self.engines) if e.policy_version != version or i in self._needs_push]
        return targets or list(range(len(self.engines)))

    def stage_plan(self, version: int, num_stages: int, **options) -> Optional[StagePlan]:
        """The plan of a push of ``version`` from every pipeline stage to the engines behind it (``stage_push``),
        kept for ``update_weights``."""
        targets = self.push_targets(version)
        plan = plan_push([self.engines[i] for i in targets], targets, version, num_stages, **options)
        self._stage_files, self._stage_targets = StageFiles.of(plan), targets
        return plan

    def take_stage_files(self) -> Optional[StageFiles]:
        """The planned push's stage files, once (None after ``update_weights`` took them)."""
        files, self._stage_files = getattr(self, "_stage_files", None), None
        return files

    def add_stage_digests(self, digests: dict) -> None:
        """The stage leaders' checksums, for each engine of the last planned push."""
        for i in getattr(self, "_stage_targets", []):
            add = getattr(self.engines[i], "add_stage_digests", None)
            if add is not None:
                add(digests)

    def update_weights(self, buckets, version: int) -> List[str]:
        """One fan-out push to the engines behind ``version`` (all of them when none is), each
        bucket read concurrently by every target engine (with a ``stage_plan``: every pipeline stage's).
        Consumes ``buckets`` whatever happens."""
        targets = self.push_targets(version)
        if len(targets) < len(self.engines):
            logger.info("pushing weights version %d to engine(s) %s only (the others hold it already)", version,
                        ", ".join(map(str, targets)))
        engines = [self.engines[i] for i in targets]
        if len(engines) == 1 and not hasattr(engines[0], "push_file"):  # an engine without the file seam
            return self._run(targets[0], lambda e: e.update_weights(buckets, version))
        streams = any(getattr(e, "weight_transfer", "file") != "file" for e in engines)  # vLLM's transfer API
        try:
            if streams:
                names = fan_out_streams(buckets, engines, version, names=lambda r: self.name(targets[r]))
            else:
                names = fan_out(buckets, engines, version, names=lambda r: self.name(targets[r]),
                                stages=self.take_stage_files())
        except BaseException as exc:
            r = getattr(exc, "engine_index", None)
            if r is not None:
                self._failed.add(targets[r])
                exc.engine_index = targets[r]
            raise
        self._needs_push -= set(targets)
        return names

    # ---- colocated engines: sleep during the trainer step (GPU) -------------------------------------------

    def sleep(self) -> None:
        """Colocated on GPU: every engine frees the device (vLLM sleep level 1) for the trainer step."""
        if self.sleep_between_steps and not self._asleep:
            self._map(lambda i: self._run(i, lambda e: e.sleep(1)), range(len(self.engines)))
            self._asleep = True

    def wake_up(self) -> None:
        """Before the weight push: the engines take their memory back (the push then overwrites the weights)."""
        if self._asleep:
            self._map(lambda i: self._run(i, lambda e: e.wake_up()), range(len(self.engines)))
            self._asleep = False


def _alive(engine) -> bool:
    if engine is None:
        return False
    alive = getattr(engine, "alive", None)
    return alive() if alive is not None else True
