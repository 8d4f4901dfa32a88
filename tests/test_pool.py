"""Engine pool (rollout/pool.py, rollout/fanout.py): sharding, seeds and versions, one fan-out push
read by every engine, the parity probe on each engine, restarts of the dead engine only.

vLLM engines are expensive (~20 s import + ~7 s start, ~1.7 GiB each): the vLLM checks share one
module-scoped 2-engine pool, and one tiny CLI run (2 engines, async, one engine killed) runs
first, before that pool exists. The other checks use fake engines and take milliseconds.
"""

import os

import pytest
import torch

from megatron_grpo.rollout import Sampling
from megatron_grpo.rollout.pool import EnginePool, cpu_bindings, engine_placement, format_placement, shard_bounds
from megatron_grpo.rollout.types import GeneratorError

from tests._fakes import FakeEngine


# ---- fake engines: the pool's bookkeeping and the fan-out, without vLLM --------------------------------------


def _buckets(num_buckets, consumed):
    for b in range(num_buckets):
        consumed.append(b)  # the gathers behind each bucket are collective: every bucket must be drawn
        yield [(f"model.layers.{b}.w", torch.full((4,), float(b))), (f"model.layers.{b}.v", torch.ones(2))]


def _bucket_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith("megatron-grpo-bucket-")}


def test_shards_seeds_and_placement_do_not_depend_on_the_engine_count():
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)] and shard_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert cpu_bindings(1, 1, [0, 1]) == [None]  # one engine: vLLM's own binding
    assert cpu_bindings(2, 1, [0, 1]) == ["0", "1"] and cpu_bindings(1, 2, range(4)) == ["0,1|2,3"]
    prompts, sampling = [[1], [2, 3], [4], [5], [6]], Sampling(seed=100)
    one = EnginePool(lambda i: FakeEngine(i), 1).generate(prompts, 3, sampling)
    three = EnginePool(lambda i: FakeEngine(i), 3).generate(prompts, 3, sampling)
    assert [(r.prompt_index, r.prompt_ids, r.completion_ids) for r in three] == \
           [(r.prompt_index, r.prompt_ids, r.completion_ids) for r in one]
    assert [r.completion_ids[0] for r in three] == [100 + p * 3 + i for p in range(5) for i in range(3)]

    from megatron_grpo.config.schema import GenerationConfig

    g = GenerationConfig(num_engines=2, tensor_parallel_size=2)
    assert [(s.ranks, s.devices) for s in engine_placement(g, 4)] == [([0, 1], [0, 1]), ([2, 3], [2, 3])]
    assert "engine 1: shares the devices of ranks 2,3" in format_placement(g, 4)
    servers = GenerationConfig(backend="vllm_server", server_urls=["http://a:1", "http://b:2"], num_engines=2)
    assert not servers.colocated and "engine 1: server http://b:2 (dedicated)" in format_placement(servers, 1)
    for bad, key in [(dict(num_engines=0), "generation.num_engines"),
                     (dict(backend="vllm_server", server_urls=["http://a:1"], num_engines=2), "generation.num_engines=1"),
                     (dict(backend="vllm_server", server_url="http://a:1", colocated=True), "generation.colocated")]:
        with pytest.raises(ValueError, match=key):
            GenerationConfig(**bad)


def test_fan_out_writes_once_reads_everywhere_and_restarts_only_the_dead_engine():
    built = []
    pool = EnginePool(lambda i: built.append(i) or FakeEngine(i), 3)
    before = _bucket_files()
    consumed = []
    names = pool.update_weights(_buckets(5, consumed), version=1)
    assert consumed == list(range(5)) and len(names) == 10 and pool.versions() == [1, 1, 1]
    assert all(sorted(e.loaded) == sorted(names) for e in pool.engines)
    pool.engines[1].fail_on_file = 2  # dies on its second bucket file
    consumed = []
    with pytest.raises(Exception, match="engine 1 of 3: engine 1 died") as err:
        pool.update_weights(_buckets(5, consumed), version=2)
    assert err.value.engine_index == 1
    assert consumed == list(range(5)) and pool.versions() == [2, 1, 2]  # the others finished their push
    assert _bucket_files() == before  # the dead engine's unread files were removed
    pool.restart_failed()
    assert built == [0, 1, 2, 1] and pool.versions() == [2, 0, 2]  # only the dead engine was rebuilt
    pool.update_weights(_buckets(2, []), version=2)
    assert pool.engines[1].policy_version == 2 and len(pool.engines[0].loaded) == 20  # engine 0 was not pushed again
    refusing = pool.engines[2]
    refusing.push_file = lambda path: (_ for _ in ()).throw(GeneratorError("bad tensor name"))  # alive, refuses
    with pytest.raises(Exception, match="engine 2 of 3: bad tensor name"):
        pool.update_weights(_buckets(2, []), version=3)
    assert refusing.policy_version == -1 and pool.versions()[:2] == [3, 3]  # its reload closed, no version claimed
    assert _bucket_files() == before
    del refusing.push_file
    pool.update_weights(_buckets(2, []), version=3)  # engine 2 alone is behind: pushed again
    assert pool.versions() == [3, 3, 3] and len(pool.engines[0].loaded) == 24
    pool.sleep(), pool.wake_up()
    assert all(e.slept == 0 for e in pool.engines)  # no-op unless sleep_between_steps (colocated on GPU)
    sleepy = EnginePool(lambda i: FakeEngine(i), 2, sleep_between_steps=True)
    sleepy.sleep()
    assert [e.slept for e in sleepy.engines] == [1, 1]
    sleepy.wake_up()
    assert [e.slept for e in sleepy.engines] == [0, 0]


class _StreamingEngine(FakeEngine):
    """An engine on vLLM's weight-transfer API: it reads the bucket stream itself (gloo sends ABORT when the
    stream raises, END when it ends)."""

    weight_transfer = "gloo"

    def update_weights(self, stream, version):
        self.policy_version = -1
        try:
            for bucket in stream:
                self.loaded += [name for name, _ in bucket]
        except Exception as exc:
            self.aborted = str(exc)
            raise
        self.policy_version = version


def _failing_gather(num_good):
    for b in range(num_good):
        yield [(f"model.layers.{b}.w", torch.full((4,), float(b)))]
    raise RuntimeError("gather on rank 3 failed")


@pytest.mark.parametrize("engine_cls", [FakeEngine, _StreamingEngine], ids=["files", "streams"])
def test_a_failed_gather_aborts_the_push_instead_of_committing_partial_weights(engine_cls):
    """The trainer's side fails after 2 of its buckets: every engine hears it (file seam: the reload is closed
    with the unknown version; stream: the stream raises, so gloo sends ABORT, not END), no engine claims the
    new version, the trainer's error propagates, and the next push goes to every engine."""
    from megatron_grpo.rollout.transfer.fanout import UNKNOWN_VERSION

    pool = EnginePool(lambda i: engine_cls(i), 2)
    before = _bucket_files()
    with pytest.raises(RuntimeError, match="gather on rank 3 failed"):
        pool.update_weights(_failing_gather(2), version=1)
    assert pool.versions() == [UNKNOWN_VERSION] * 2 and _bucket_files() == before
    assert all(len(e.loaded) == 2 for e in pool.engines)
    if engine_cls is _StreamingEngine:
        assert all("the trainer's side of the push failed: RuntimeError: gather on rank 3" in e.aborted
                   for e in pool.engines)
    assert pool.push_targets(1) == [0, 1]
    pool.update_weights(_buckets(1, []), version=1)
    assert pool.versions() == [1, 1]


@pytest.fixture
def arm_faults(monkeypatch):
    """``arm(spec)``: sets ``MEGATRON_GRPO_FAULT_KILL_GENERATOR``, counting generator starts from then on
    (``start:1`` = the next engine built) and forgetting the kills done before."""
    import itertools

    from megatron_grpo import faults

    def arm(spec):
        monkeypatch.setattr(faults, "_generator_starts", itertools.count(1))
        monkeypatch.setattr(faults, "_generator_killed", set())
        monkeypatch.setenv(faults.KILL_GENERATOR, spec)

    return arm


def test_an_engine_that_dies_while_restarting_stays_failed_and_is_restarted_alone(arm_faults):
    """Both engines die; one of their restarts (started concurrently) dies while starting (the 4th start): the
    error names it, the other's fresh engine is kept (not closed with it), and the next restart rebuilds the
    failed one alone; the push then goes to both (neither holds the weights)."""
    built = []
    arm_faults("start:4")
    pool = EnginePool(lambda i: built.append(i) or FakeEngine(i), 2)
    first = list(pool.engines)
    for engine in first:
        engine.kill_process()
    with pytest.raises(GeneratorError, match=r"^engine \d of 2 failed to start: fake generator process died during "
                                             r"start \(exit code -9\)") as err:
        pool.restart_failed()
    failed = err.value.engine_index
    assert str(err.value).startswith(f"engine {failed} of 2") and sorted(built) == [0, 0, 1, 1]
    kept = pool.engines[1 - failed]
    assert pool.engines[failed] is None and kept not in first and kept.alive()
    assert pool.restart_failed() == [failed] and pool.engines[1 - failed] is kept and pool.engines[failed].alive()
    assert sorted(built) == sorted([0, 0, 1, 1, failed]) and pool.push_targets(0) == [0, 1]
    pool.update_weights(_buckets(1, []), version=0)
    assert pool.versions() == [0, 0] and all(len(e.loaded) == 2 for e in pool.engines)


def _loop_over_fake_engines(log_dir, num_steps, max_restarts, rank=0, staleness=0):
    """The real ``GRPOTrainer.train`` loop, rollouts (``next_rollouts``) and push (``push_weights``, the
    gather stubbed) around a 1-engine pool of fakes held by rank 0; the step records each rollout's prompt,
    tokens and version, the pool each engine it builds."""
    import collections
    import time

    from megatron_grpo.config.schema import Config, to_dict
    from megatron_grpo.observe.doctor import LiveDoctor
    from megatron_grpo.observe.metrics_logger import MetricsLogger
    from megatron_grpo.rollout.staleness import StalenessGate
    from megatron_grpo.rollout.transfer.weight_sync import PushReport
    from megatron_grpo.trainer.loop import GRPOTrainer

    class Sampler:
        def __init__(self):
            self.drawn = 0

        def next(self, n):
            self.drawn += n
            return [[self.drawn - n + k] for k in range(n)]

    class Trainer(GRPOTrainer):
        def __init__(self):
            self._started, self.step, self.version, self.consecutive_skips = time.perf_counter(), 0, 0, 0
            self._stop_requested, self.delta, self.seen, self.built = False, None, [], []
            self._pending, self._planned = collections.deque(), {}
            self.cfg = Config()
            self.cfg.grpo.max_num_steps, self.cfg.grpo.num_prompts_per_step = num_steps, 2
            self.cfg.grpo.num_generations_per_prompt = 2
            self.cfg.generation.max_restarts, self.cfg.generation.parity_probe_every = max_restarts, 0
            self.cfg.logger.log_dir = str(log_dir)
            self.cfg.generation.max_staleness = staleness
            self.gate = StalenessGate(staleness)
            engine = EnginePool(lambda i: self.built.append(i) or FakeEngine(i), 1) if rank == 0 else None
            self.ctx = type("Ctx", (), {"rank": rank, "device": torch.device("cpu"), "eos_id": 0,
                                        "sampler": Sampler(), "engine": engine})()
            self.logger = MetricsLogger(str(log_dir), enabled=rank == 0, tensorboard=False, progress_bar=False,
                                        total_steps=num_steps)
            self.doctor = LiveDoctor(to_dict(self.cfg))

        def stop_requested(self):
            return False

        def _push_once(self):
            if self.ctx.engine is None:  # rank 1: its share of the (stubbed) gather
                return PushReport(version=self.version)
            names = self.ctx.engine.update_weights(_buckets(1, []), self.version)
            return PushReport(version=self.version, names=names)

        def train_step(self):
            rollouts = self.next_rollouts()
            self.seen.append([(r.prompt_ids, r.completion_ids, r.policy_version) for r in rollouts])
            self.version += 1
            self.push_weights(probe=False)
            return {"reward/mean": 0.0}

    return Trainer()


def _rank_of_the_faulty_run(log_dir):
    from megatron_grpo.parallel import state

    state.init_distributed()
    trainer = _loop_over_fake_engines(log_dir, 4, max_restarts=2, rank=int(os.environ["RANK"]))
    return trainer.train(), trainer.seen, trainer.built


def test_a_generator_killed_again_while_restarting_is_one_more_restart_and_the_run_finishes(
        tmp_path, arm_faults, caplog):
    """The fault drill's case, on fakes, 2 gloo ranks (rank 0 holds the engine): killed during step 3's
    generation, then again while it restarts (the 2nd start): every rank agrees that the start failed, it
    is one more failure of the step's budget (``generation.max_restarts`` = 2), the next restart works, and
    every step trains on the rollouts of an uninterrupted run (same prompts and seeds; the restarted engine
    got the current weights before regenerating). With ``max_restarts`` = 1 the same faults end the run,
    naming the failed start."""
    from tests._dist import run_distributed

    straight = _loop_over_fake_engines(tmp_path / "straight", 4, max_restarts=2)
    assert straight.train() == 0
    base = straight.cfg.grpo.seed * 1_000_003 + 2 * 10_007  # step 3's sampling seed; completion i of prompt p: +p*n+i
    assert [ids for _, ids, _ in straight.seen[2]] == [[base + k] for k in range(4)]
    arm_faults("generate:3,start:2")
    ranks = run_distributed(_rank_of_the_faulty_run, 2, str(tmp_path / "faults"), timeout=600)
    assert [code for code, _, _ in ranks] == [0, 0] and [built for _, _, built in ranks] == [[0, 0, 0], []]
    for _, seen, _ in ranks:
        assert seen == straight.seen and [{v for _, _, v in step} for step in seen] == [{0}, {1}, {2}, {3}]
    arm_faults("generate:3,start:2")
    short = _loop_over_fake_engines(tmp_path / "budget", 4, max_restarts=1)
    with pytest.raises(GeneratorError, match=r"generator failed 2 times during its restart at step 3; last error: "
                                             r"engine 0 of 1 failed to start: fake generator process died"):
        short.train()
    assert len(short.seen) == 2 and short.built == [0, 0]
    assert "generator failed during generation at step 3 (engine 0 of 1: fake generator process is not running" \
        in caplog.text


def test_an_async_run_resumed_from_its_checkpoint_trains_on_the_generations_that_were_in_flight(tmp_path):
    """max_staleness = 1: the checkpoint after step 2 holds step 3's generation, submitted before step 2
    trained (weights version 1) and whose prompts the saved data position has passed. A run resumed from it
    (a fresh engine, pushed the resumed weights, version 2) trains steps 3-4 on exactly the uninterrupted
    run's rollouts: the same prompts, completions and versions. Without them (a checkpoint from before they
    were saved) step 3 trains on the next step's prompts, generated on-policy. Resumed with another
    temperature, step 3 is regenerated with it (before, it trained on the saved rollouts of temperature 1.0
    while its log-probs used 0.7: wrong old log-probs, no error)."""
    import io

    straight = _loop_over_fake_engines(tmp_path / "straight", 4, max_restarts=0, staleness=1)
    assert straight.train() == 0
    assert [{v for _, _, v in step} for step in straight.seen] == [{0}, {0}, {1}, {2}]  # one version of lag

    def first_two_steps():
        first = _loop_over_fake_engines(tmp_path / "first", 4, max_restarts=0, staleness=1)
        first.cfg.checkpointing.checkpoint_dir, first.cfg.checkpointing.save_period = str(tmp_path / "ck"), 1
        saved = []

        def save():  # the in-flight part of trainer_state.pt, through torch.save / load(weights_only=True)
            buffer = io.BytesIO()
            torch.save({"in_flight": first.in_flight_state()}, buffer)
            buffer.seek(0)
            saved.append(torch.load(buffer, weights_only=True)["in_flight"])

        first.save, first.stop_requested = save, lambda: first.step >= 2
        first.train()  # stops after step 2 (and its save), as at a signal
        assert first.seen == straight.seen[:2] and len(saved[-1]) == 1 and saved[-1][0]["step"] == 2
        return first, saved[-1]

    def resumed(first, in_flight, temperature=1.0):
        again = _loop_over_fake_engines(tmp_path / "again", 4, max_restarts=0, staleness=1)
        again.cfg.generation.temperature = temperature
        again.step, again.version, again.ctx.sampler.drawn = first.step, first.version, first.ctx.sampler.drawn
        again.push_weights(probe=False)  # a resume pushes the checkpoint's weights to the new engine
        again.restore_in_flight(in_flight)
        planned = dict(again._planned)
        assert again.train() == 0
        return again.seen, planned

    assert resumed(*first_two_steps())[0] == straight.seen[2:]
    old = resumed(first_two_steps()[0], None)[0]
    assert old != straight.seen[2:] and {v for _, _, v in old[0]} == {2}
    # resumed with another temperature: the trainer's log-probs use it, so the saved rollouts (sampled at 1.0)
    # are regenerated with it (same prompts and seeds, the resumed weights' version), not trained on
    hotter, planned = resumed(*first_two_steps(), temperature=0.7)
    assert [(p, ids) for p, ids, _ in hotter[0]] == [(p, ids) for p, ids, _ in straight.seen[2]]
    assert {v for _, _, v in hotter[0]} == {2} and hotter[1] == straight.seen[3]
    assert [sampling.temperature for _, sampling in planned.values()] == [0.7]


def test_a_checkpoint_after_a_generator_restart_keeps_the_planned_prompts_of_the_cleared_generation(
        tmp_path, arm_faults):
    """max_staleness = 1, the generator killed during step 2's weight push: its restart clears step 3's
    generation in flight (submitted before step 2 trained), whose prompts and seeds stay planned and the saved
    data position has passed. The checkpoint after step 2 keeps them (without rollouts), so the resumed run's
    step 3 regenerates the uninterrupted run's prompts with the same seeds (the fakes' completion ids are the
    sampling seeds), at the resumed weights' version, as the live run does. Before, nothing was saved and step 3
    trained on step 4's prompts: one batch of prompts skipped."""
    import io

    straight = _loop_over_fake_engines(tmp_path / "straight", 4, max_restarts=0, staleness=1)
    assert straight.train() == 0
    arm_faults("push:2")
    first = _loop_over_fake_engines(tmp_path / "first", 4, max_restarts=1, staleness=1)
    first.cfg.checkpointing.checkpoint_dir, first.cfg.checkpointing.save_period = str(tmp_path / "ck"), 1
    saved = []

    def save():
        buffer = io.BytesIO()
        torch.save({"in_flight": first.in_flight_state()}, buffer)
        buffer.seek(0)
        saved.append(torch.load(buffer, weights_only=True)["in_flight"])

    first.save, first.stop_requested = save, lambda: first.step >= 2
    first.train()
    assert first.seen == straight.seen[:2] and first.built == [0, 0]  # the restart after the killed push
    assert [(g["step"], g["prompts"], g["rollouts"]) for g in saved[-1]] == [(2, [[4], [5]], None)]
    again = _loop_over_fake_engines(tmp_path / "again", 4, max_restarts=0, staleness=1)
    again.step, again.version, again.ctx.sampler.drawn = first.step, first.version, first.ctx.sampler.drawn
    again.push_weights(probe=False)
    again.restore_in_flight(saved[-1])
    assert again.train() == 0
    assert [[(p, ids) for p, ids, _ in step] for step in again.seen] == \
        [[(p, ids) for p, ids, _ in step] for step in straight.seen[2:]]
    assert [{v for _, _, v in step} for step in again.seen] == [{2}, {2}]  # regenerated at the resumed weights


# ---- vLLM: one tiny training run, then a shared 2-engine pool -------------------------------------------------

pytest_vllm = pytest.mark.vllm


@pytest_vllm
def test_two_engine_async_run_restarts_a_killed_engine_without_losing_a_step(tmp_path, tiny_dense, monkeypatch):
    """max_staleness=1 with 2 engines; engine 1 is SIGKILLed before step 2's weight push: it alone is
    restarted and pushed to (engine 0 keeps its weights), the probe checks both, and every step runs."""
    from tests.test_train import run_cli

    monkeypatch.setenv("MEGATRON_GRPO_FAULT_KILL_GENERATOR", "push:2")
    code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=3", "generation.num_engines=2",
                               "generation.max_staleness=1", "grpo.deployed_improvement=false",
                               "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
                               "generation.max_new_tokens=8"], str(tmp_path))
    assert code == 0, out[-4000:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert out.count("restarting generator engine(s) 1 of 2") == 1
    assert "pushing weights version 2 to engine(s) 1 only" in out
    lags = [r["rollout/policy_version_lag"] for r in rows]
    assert lags[:2] == [0, 1] and max(lags) <= 1 and all(r["rollout/dropped_stale"] == 0 for r in rows)
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-4 for r in rows)


@pytest.fixture(scope="module")
def pool(tiny_dense):
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine

    binds = cpu_bindings(2, 1, sorted(os.sched_getaffinity(0)))
    engines = EnginePool(lambda i: VLLMEngine(tiny_dense, torch.float32, max_model_len=128, cpu_bind=binds[i]), 2)
    yield engines
    engines.close()


def _hf_scores(model_dir, weights, probe):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.load_state_dict(weights, strict=False)
    out = []
    with torch.no_grad():
        for seq, start in zip(probe.sequences, probe.prompt_lens):
            lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
            out.append([lp[t - 1, seq[t]].item() for t in range(start, len(seq))])
    return out


@pytest_vllm
def test_two_engines_give_exactly_the_rollouts_of_one(pool):
    """fp32, same seeds: the 2-engine pool's rollouts are engine 0's alone (a 1-engine pool), in prompt
    order, whether collected at once or with two generations in flight (the async path)."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16], [17]]
    sampling = Sampling(max_tokens=12, temperature=0.8, seed=3)
    first = pool.submit_generate(prompts, 3, sampling)
    second = pool.submit_generate(prompts[::-1], 2, Sampling(max_tokens=8, seed=4))  # in flight together
    two, other = pool.collect(first), pool.collect(second)
    one = pool.engines[0].generate(prompts, 3, sampling)
    assert [r.prompt_index for r in two] == [p for p in range(5) for _ in range(3)]
    assert [(r.prompt_ids, r.completion_ids, r.logprobs) for r in two] == \
           [(r.prompt_ids, r.completion_ids, r.logprobs) for r in one]
    assert len({tuple(r.completion_ids) for r in two}) > 5 and len(other) == 10
    assert pool.engines[0].generate(prompts[::-1], 2, Sampling(max_tokens=8, seed=4)).items[7].completion_ids == \
           other.items[7].completion_ids  # engine 1's shard, reproduced by engine 0 alone
    seqs = [r.prompt_ids + r.completion_ids for r in two.items[:4]]
    assert pool.score(seqs, [len(r.prompt_ids) for r in two.items[:4]]) == \
           pool.engines[0].score(seqs, [len(r.prompt_ids) for r in two.items[:4]])
    assert all(r.policy_version == 0 for r in two) and pool.versions() == [0, 0]


@pytest_vllm
def test_one_push_reaches_both_engines_and_the_probe_names_a_stale_one(pool, tiny_dense):
    from safetensors.torch import load_file

    from megatron_grpo.rollout.transfer.fanout import fan_out
    from megatron_grpo.rollout.parity import ParityError, ProbeBatch, check_parity

    base = load_file(os.path.join(tiny_dense, "model.safetensors"))
    items = list({k: v * 1.05 for k, v in base.items()}.items())
    split = next(i for i, (k, _) in enumerate(items) if k.startswith("model.layers.2."))  # buckets end at layers
    before = _bucket_files()
    probe = ProbeBatch.sampled(pool, [[5, 6, 7], [8, 9], [10, 11, 12], [13]], 10, seed=11)
    assert pool.update_weights([items[:split], items[split:]], version=1) == [k for k, _ in items]
    assert pool.versions() == [1, 1] and _bucket_files() == before
    hf = _hf_scores(tiny_dense, dict(items), probe)
    metrics = check_parity(pool, probe, lambda _: hf, [k for k, _ in items], 1e-4, 1)
    assert metrics["sync/logprob_abs_diff_max"] < 1e-4  # both engines follow the one push
    newer = [(k, v * 1.1) for k, v in items]
    fan_out([newer], [pool.engines[1]], version=2)  # engine 1 alone moves on
    with pytest.raises(ParityError, match=r"^engine 1 of 2 \(vllm pid \d+\): weight push of version 2 failed"):
        check_parity(pool, probe, lambda _: hf, [k for k, _ in items], 1e-4, 2)


def test_engines_under_one_visible_gpu_per_task(monkeypatch, tmp_path):
    """``srun --gpus-per-task=1``: rank 0 (LOCAL_RANK 0 of 4) sees only its own GPU. A colocated engine
    shares it; one more (colocated on rank 1's GPU, or dedicated) is refused naming why, before any
    engine starts (rank 0 spawns every engine and cannot reach the other ranks' GPUs)."""
    import types

    from megatron_grpo import rollout
    from megatron_grpo.trainer import build as setup
    from megatron_grpo.config.schema import Config, from_dict

    seen = []

    class Engine:
        def __init__(self, model_dir, dtype, **kwargs):
            seen.append(kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # this task's GPU, as the node numbers it
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(rollout.ROLLOUT_ENGINES, "get", lambda name: Engine)
    cfg = from_dict(Config, {"generation": {"num_engines": 1}, "logger": {"log_dir": str(tmp_path)}})
    setup._build_engine(cfg, str(tmp_path), types.SimpleNamespace(is_moe=False)).close()
    assert seen[0]["devices"] == ["5"]
    cfg.generation.num_engines = 2
    with pytest.raises(ValueError, match=r"rank 0 sees 1 GPU.*CUDA_VISIBLE_DEVICES=5.*--gpus-per-task"):
        setup._build_engine(cfg, str(tmp_path), types.SimpleNamespace(is_moe=False))
    cfg.generation.num_engines, cfg.generation.colocated = 1, False
    with pytest.raises(ValueError, match=r"dedicated engines after the trainer's 1 on rank 0's node, which has 1"):
        setup._build_engine(cfg, str(tmp_path), types.SimpleNamespace(is_moe=False))


def test_engine_placement_stays_on_rank0s_node_and_never_wraps_onto_trainer_gpus(monkeypatch):
    """Multi-node: rank 0 spawns every local engine on its own node (LOCAL_WORLD_SIZE of the world's ranks);
    engines that do not fit there are an error on GPU (CPU: they share the cores), and a device index past
    the visible GPUs is an error instead of a wrap onto a trainer's GPU."""
    from megatron_grpo.trainer import build as setup
    from megatron_grpo.config.schema import Config, GenerationConfig, from_dict
    from megatron_grpo.trainer.layout import describe_layout

    colocated = GenerationConfig(num_engines=2, tensor_parallel_size=4, colocated=True)
    slots = engine_placement(colocated, 16, local_world_size=8, num_local_gpus=8)  # 2 nodes x 8 GPUs
    assert [(s.ranks, s.devices) for s in slots] == [([0, 1, 2, 3], [0, 1, 2, 3]), ([4, 5, 6, 7], [4, 5, 6, 7])]
    too_many = GenerationConfig(num_engines=3, tensor_parallel_size=4, colocated=True)
    with pytest.raises(ValueError, match=r"generation.num_engines=3 x generation.tensor_parallel_size=4 = 12 GPUs.*"
                                         r"8 trainer rank\(s\) \(LOCAL_WORLD_SIZE\)"):
        engine_placement(too_many, 16, local_world_size=8, num_local_gpus=8)
    assert len(engine_placement(too_many, 2)) == 3  # CPU: the engines split the cores
    dedicated = GenerationConfig(num_engines=1, tensor_parallel_size=2, colocated=False)
    assert engine_placement(dedicated, 12, local_world_size=6, num_local_gpus=8)[0].devices == [6, 7]
    with pytest.raises(ValueError, match=r"dedicated engines after the trainer's 8 on rank 0's node, which has 8"):
        engine_placement(dedicated, 16, local_world_size=8, num_local_gpus=8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert setup._visible_devices([2, 3]) == ["6", "7"]
    with pytest.raises(ValueError, match=r"local GPU 4 does not exist \(this process sees 4"):
        setup._visible_devices([4])  # used to wrap onto "4": a trainer's GPU
    cfg = from_dict(Config, {"generation": {"num_engines": 3, "tensor_parallel_size": 4, "colocated": True},
                             "cluster": {"gpus_per_node": 8}})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        describe_layout(cfg, 16)  # the dry run checks the cluster's node, not this machine
    with pytest.raises(ValueError, match=r"generation.backend=megatron needs policy.megatron_cfg."
                                         r"pipeline_model_parallel_size=1 \(got 2\)"):
        from_dict(Config, {"generation": {"backend": "megatron"},
                           "policy": {"megatron_cfg": {"pipeline_model_parallel_size": 2}}})
