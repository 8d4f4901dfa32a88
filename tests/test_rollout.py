"""vLLM rollout engine: log-probs vs transformers per dtype, weight push + parity probe (TP=1/2), staleness."""

import json
import os
import warnings

import pytest
import torch

from megatron_grpo.rollout import Sampling
from megatron_grpo.rollout.staleness import StalenessGate
from tests._dist import run_distributed
from tests._netns import veth_hosts

# mean / max |vLLM - transformers| log-prob allowed in the same dtype. ENVIRONMENT.md measured on a
# tiny Qwen3: fp32 6e-7 / 2e-6, fp16 1e-3 / 6e-3, bf16 1e-2 / 5e-2; we allow ~3-10x that.
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float16: (5e-3, 5e-2), torch.bfloat16: (3e-2, 0.3)}


def _hf_completion_logprobs(model_dir, rollouts, dtype, temperature):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    out = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = hf(ids).logits[0].float() / temperature
            lp = torch.log_softmax(logits, -1)
            p = len(r.prompt_ids)
            out.append([lp[p - 1 + t, tok].item() for t, tok in enumerate(r.completion_ids)])
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_generate_n_completions_with_logprobs_matching_transformers(dtype, tiny_dense):
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_dense, dtype, max_model_len=128)
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        rollouts = engine.generate(prompts, 3, Sampling(max_tokens=12, temperature=0.8, seed=3))
        again = engine.generate(prompts, 3, Sampling(max_tokens=12, temperature=0.8, seed=3))
        stop = rollouts.items[0].completion_ids[0]  # ignore_eos: neither EOS nor a stop token ends a row
        forced = engine.generate(prompts, 3, Sampling(max_tokens=12, temperature=0.8, seed=3, stop_token_ids=(stop,),
                                                      ignore_eos=True))
    finally:
        engine.close()
    assert all(len(r.completion_ids) == 12 and r.finish_reason == "length" for r in forced)
    assert [f.completion_ids[: len(r.completion_ids)] for f, r in zip(forced, rollouts)] == \
        [r.completion_ids for r in rollouts]
    assert len(rollouts) == 6
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1]
    assert all(len(r.completion_ids) == len(r.logprobs) > 0 and r.policy_version == 0 for r in rollouts)
    assert len({tuple(r.completion_ids) for r in rollouts.items[:3]}) > 1  # n distinct samples
    assert [r.completion_ids for r in rollouts] == [r.completion_ids for r in again]  # seeded
    ref = _hf_completion_logprobs(tiny_dense, rollouts, dtype, 0.8)
    diffs = torch.tensor([abs(a - b) for r, row in zip(rollouts, ref) for a, b in zip(r.logprobs, row)])
    mean_tol, max_tol = TOLERANCE[dtype]
    assert diffs.mean().item() <= mean_tol and diffs.max().item() <= max_tol, (diffs.mean(), diffs.max())


def _push_worker(model_dir, tp, transport):
    """Rank 0 hosts vLLM; every rank perturbs its shard, pushes, and runs the probe."""
    import torch.distributed as dist

    from megatron_grpo.models import forward as F
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.parallel import comm, state
    from megatron_grpo.rollout.parity import ParityError, ProbeBatch, check_parity
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine
    from megatron_grpo.rollout.transfer.weight_sync import push_weights

    state.initialize_model_parallel(state.Layout(world_size=int(os.environ["WORLD_SIZE"]), tp=tp))
    from megatron.core import parallel_state as ps

    model, shape = build_from_hf(model_dir)
    rank0 = dist.get_rank() == 0
    engine = VLLMEngine(model_dir, torch.float32, max_model_len=128, weight_transfer=transport) if rank0 else None
    probe = ProbeBatch.synthetic(shape.vocab_size)
    packed = F.pack(probe.sequences, probe.prompt_lens)

    def scores(p):
        lp = F.forward_log_probs(model, packed, compute_dtype=torch.float32, params_dtype=torch.float32,
                                 tp_group=ps.get_tensor_model_parallel_group())
        return F.completion_scores(lp, packed)

    def probe_on_rank0(names, tol, version):
        ours = scores(probe)  # collective: every rank runs the forward
        if not rank0:
            return comm.broadcast_object(None)
        try:
            result = check_parity(engine, probe, lambda _: ours, names, tol, version)
        except ParityError as exc:
            result = str(exc)
        return comm.broadcast_object(result)

    out = {}
    old_engine_scores = engine.score(probe.sequences, probe.prompt_lens) if rank0 else None
    with torch.no_grad():
        gen = torch.Generator().manual_seed(100)  # same noise on every rank keeps replicated params equal
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    report = push_weights(model, shape, engine, 1, dtype=torch.float32, bucket_mb=0.25)
    out["good"] = probe_on_rank0(report.names, 1e-4, 1)
    if rank0:
        new_scores = engine.score(probe.sequences, probe.prompt_lens)
        out["moved"] = max(abs(a - b) for x, y in zip(old_engine_scores, new_scores) for a, b in zip(x, y))
        out["num_buckets_bytes"] = report.max_bucket_bytes
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    dropped = push_weights(model, shape, engine, 2, dtype=torch.float32,
                           transform=lambda n, t: None if n == "model.layers.1.mlp.down_proj.weight" else (n, t))
    out["dropped"] = probe_on_rank0(dropped.names, 1e-4, 2)
    try:
        push_weights(model, shape, engine, 3, dtype=torch.float32,
                     transform=lambda n, t: (n.replace("layers.0.mlp.up_proj", "layers.0.mlp.upp_proj"), t))
        out["misnamed"] = None
    except ParityError as exc:
        out["misnamed"] = str(exc)
    if engine is not None:
        engine.close()
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("tp, transport", [(1, "file"), (2, "gloo")])
def test_push_follows_weights_and_probe_catches_bad_pushes(tp, transport, tiny_dense, capfd):
    """TP = 2 also takes the offline ``LLM`` weight-transfer API (gloo engine, checksums in the probe). Quiet
    with many buckets: one layerwise reload per push, so vLLM warns only about a layer no bucket loaded (the
    push that drops layer 1's down_proj), not about every layer outside each bucket (176 lines before)."""
    results = run_distributed(_push_worker, tp, tiny_dense, tp, transport)
    captured = capfd.readouterr()  # vLLM logs to stdout
    failed = [line for line in (captured.out + captured.err).splitlines() if "Failed to load weights" in line]
    assert 1 <= len(failed) <= tp and all("RowParallelLinear" in line for line in failed), failed[:5]  # per worker
    r0 = results[0]
    assert isinstance(r0["good"], dict) and r0["good"]["sync/logprob_abs_diff_mean"] < 1e-4
    assert r0["moved"] > 1e-2  # vLLM follows the new weights, not the old ones
    assert r0["num_buckets_bytes"] < 1.5 * 2**20  # buckets of ~0.25 MiB closed at layer ends, not the whole model
    assert isinstance(r0["dropped"], str) and "failed the parity probe" in r0["dropped"]
    assert "model.layers.0.mlp.up_proj.weight" in r0["dropped"]  # the message lists the pushed names
    assert "model.layers.1.mlp.down_proj.weight" not in r0["dropped"].split("Pushed tensors:")[1][:10_000]
    misnamed = [r["misnamed"] for r in results if r["misnamed"] is not None]
    assert misnamed and "upp_proj" in misnamed[0]


def _delta_worker(model_dir, transport):
    """fp32 params, bf16 engine: 6 delta pushes (full at 0 and 3) over 5 AdamW steps, then a dense push of
    the same weights: the engine's checksums and log-probs must not move (the delta left it bit-identical)."""
    from megatron_grpo.models import build_from_hf
    from megatron_grpo.models.qwen3 import unwrap
    from megatron_grpo.parallel import state
    from megatron_grpo.rollout.engines.vllm_engine import VLLMEngine
    from megatron_grpo.rollout.parity import ProbeBatch
    from megatron_grpo.rollout.transfer.delta import DeltaState
    from megatron_grpo.rollout.transfer.weight_sync import push_weights

    state.initialize_model_parallel(state.Layout(world_size=1))
    model, shape = build_from_hf(model_dir)
    engine = VLLMEngine(model_dir, torch.bfloat16, max_model_len=128, weight_transfer=transport)
    probe = ProbeBatch.synthetic(shape.vocab_size)
    try:
        params = [p for p in unwrap(model).parameters() if p.requires_grad]
        opt, gen = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0), torch.Generator().manual_seed(0)
        delta, reports = DeltaState(full_every=3), []
        before = engine.score(probe.sequences, probe.prompt_lens)
        for version in range(6):
            if version:
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            reports.append(push_weights(model, shape, engine, version, dtype=torch.bfloat16, bucket_mb=0.25,
                                        delta=delta))
        after_delta = (engine.weight_checksums(), engine.score(probe.sequences, probe.prompt_lens),
                       dict(engine.pushed_digests))
        dense = push_weights(model, shape, engine, 6, dtype=torch.bfloat16, bucket_mb=0.25)
        after_dense = (engine.weight_checksums(), engine.score(probe.sequences, probe.prompt_lens),
                       dict(engine.pushed_digests))
    finally:
        engine.close()
    return dict(reports=[(r.full, r.num_bytes, r.dense_bytes, r.num_patched) for r in reports], dense=dense.num_bytes,
                before=before, after_delta=after_delta, after_dense=after_dense)


@pytest.mark.vllm
@pytest.mark.parametrize("transport", ["file", "gloo"])
def test_delta_push_leaves_the_engine_bit_identical_to_a_dense_push(transport, tiny_dense):
    r = run_distributed(_delta_worker, 1, tiny_dense, transport)[0]
    fulls = [full for full, *_ in r["reports"]]
    assert fulls == [True, False, False, True, False, False]
    for full, sent, dense_bytes, patched in r["reports"]:
        assert dense_bytes == r["dense"]
        assert (sent >= dense_bytes and not patched) if full else (sent < 0.9 * dense_bytes and patched > 0)
    sums_delta, scores_delta, ours_delta = r["after_delta"]
    sums_dense, scores_dense, ours_dense = r["after_dense"]
    assert sums_delta == sums_dense and len(sums_delta) > 10  # every vLLM parameter's sha256
    assert scores_delta == scores_dense and scores_delta != r["before"]  # the weights moved, identically
    if transport == "gloo":
        assert ours_delta == ours_dense and ours_delta  # the probe's trainer-side checksums: as a dense push's


def test_server_replies_are_checked_sample_by_sample(monkeypatch):
    """A server reply with too few samples for a prompt is an error naming the server and the prompt (an
    ``assert`` vanishes under ``python -O``), not a batch whose groups silently shift by one."""
    from megatron_grpo.rollout.engines.vllm_server import VLLMServerEngine

    engine = object.__new__(VLLMServerEngine)
    engine.url, engine.model_dir, engine.policy_version = "http://10.0.0.7:8000", "m", 0

    def reply(path, body):
        k = 1 if body["prompt"] == [8, 9] else body["n"]
        return {"choices": [dict(index=i, token_ids=[3], logprobs=dict(token_logprobs=[-0.5]), finish_reason="stop")
                            for i in range(k)]}

    monkeypatch.setattr(engine, "_post", reply)
    assert len(engine.generate([[5, 6, 7]], 2, Sampling(max_tokens=4, seed=1))) == 2
    with pytest.raises(ValueError, match=r"vLLM server http://10.0.0.7:8000 returned 1 samples for prompt 1, asked for 2"):
        engine.generate([[5, 6, 7], [8, 9]], 2, Sampling(max_tokens=4, seed=1))


def test_staleness_gate_never_accepts_two_versions_old():
    gate = StalenessGate(1)
    assert gate.accept(4, 4) and gate.accept(3, 4)
    assert not gate.accept(2, 4, count=8)
    assert gate.dropped == 8
    sync = StalenessGate(0)
    assert sync.accept(4, 4) and not sync.accept(3, 4)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(-1)


@pytest.mark.vllm
def test_async_pipeline_is_max_staleness_deep_and_probes_at_temperature_one(tmp_path, tiny_dense):
    """max_staleness = 2 really trains on rollouts two versions old (a two-deep pipeline); at
    T = 0.7 the start-up parity probe passes (both sides score at T = 1) and stays tight."""
    from tests.test_train import run_cli

    code, out, rows = run_cli([f"policy.model_name={tiny_dense}", "grpo.max_num_steps=5", "generation.temperature=0.7",
                               "generation.max_staleness=2", "grpo.deployed_improvement=false"], str(tmp_path))
    assert code == 0, out[-3000:]
    lags = [r["rollout/policy_version_lag"] for r in rows]
    assert lags == [0, 1, 2, 2, 2]  # generated ahead: step k trains on weights k - 2
    assert all(r["rollout/dropped_stale"] == 0 for r in rows)
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-4 for r in rows)
    assert all("sync/logprob_diff_vs_baseline" in r for r in rows)
    assert max(r["policy/kl_rollout"] for r in rows[2:]) > 0  # two versions of lag: alpha is policy movement


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRIVATE_MOUNTS_SCRIPT = r"""set -e
mount -t tmpfs tmpfs /dev/shm
[ -z "$KEEP" ] || mount --bind /tmp "$STASH"
mount -t tmpfs tmpfs /tmp
for p in $KEEP; do mkdir -p "$p"; mount --bind "$STASH${p#/tmp}" "$p"; done
[ -z "$KEEP" ] || umount -l "$STASH"
exec "$@"
"""
"""Own /dev/shm and /tmp; the paths under /tmp the server runs from (``$KEEP``: its Python, this checkout,
when a CI clones under /tmp) are bound back from the old /tmp, reached through ``$STASH`` and let go."""


def private_mounts(stash: str):
    """A command prefix: run with its own /dev/shm and /tmp (a private mount namespace), nothing shared on
    disk but what the server itself runs from."""
    import sys

    keep = sorted({os.path.realpath(p) for p in (sys.prefix, ROOT)
                   if os.path.realpath(p).startswith("/tmp/")})
    return ["unshare", "--mount", "--propagation", "private", "env", f"KEEP={' '.join(keep)}", f"STASH={stash}",
            "sh", "-c", PRIVATE_MOUNTS_SCRIPT, "another-host"]


@pytest.fixture
def another_host(tmp_path_factory):
    """A network namespace reached over a veth pair (trainer side 10.231.N.1, server side 10.231.N.2) and a
    launch prefix that runs a process inside it with its own /dev/shm and /tmp: a generator host as a cluster
    has it (another address, another route, nothing shared but the network). Where network namespaces are not
    permitted, the private mounts alone on 127.0.0.1. Yields (prefix, server address)."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: the other-host server test needs it")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs tmpfs /dev/shm"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not permitted here (needs root / CAP_SYS_ADMIN): {probe.stderr.strip()}")
    stash = tempfile.mkdtemp(prefix="mgrpo-stash-", dir="/var/tmp")  # outside /tmp: a mount point for the old one
    try:
        with veth_hosts("mgrpo", f"10.231.{os.getpid() % 250 + 1}", isolated=(False, True)) as hosts:
            if hosts is None:
                warnings.warn("the server gets private mounts on 127.0.0.1 only")
                yield private_mounts(stash), "127.0.0.1"
            else:
                yield hosts[1].prefix + private_mounts(stash), hosts[1].address
    finally:
        shutil.rmtree(stash, ignore_errors=True)


def _hf_scores(model_dir, weights, sequences, prompt_lens):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.load_state_dict(weights, strict=False)
    out = []
    with torch.no_grad():
        for seq, start in zip(sequences, prompt_lens):
            lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
            out.append([lp[t - 1, seq[t]].item() for t in range(start, len(seq))])
    return out


@pytest.mark.vllm
def test_server_on_another_host_gloo_push_from_two_stages_parity_and_dead_server_error(tiny_dense, another_host):
    """One server for every server check, as on another host: its own network namespace (reached at
    10.231.N.2 over a veth pair; its workers find the trainer's store at the address of the route to it,
    10.231.N.1, not loopback) and its own /dev/shm and /tmp, so the file transport cannot reach it.
    Weights go through vLLM's weight-transfer API with our gloo engine (the vllm.general_plugins entry
    point), from two senders at once (two pipeline stages, each its own layers); generate, parity
    (log-probs, version, checksums), a second push moves the log-probs to the new weights; then a dead
    server errors, never hangs."""
    import shutil
    import signal
    import tempfile
    import threading

    from safetensors.torch import load_file

    from megatron_grpo.rollout.transfer.fanout import SharedFileFanout
    from megatron_grpo.rollout.transfer.gloo_transfer import GlooSender
    from megatron_grpo.rollout.parity import ProbeBatch, check_parity, check_weights
    from megatron_grpo.rollout.types import GeneratorError
    from megatron_grpo.rollout.engines.vllm_server import VLLMServerEngine

    prefix, host = another_host
    model_dir = shutil.copytree(tiny_dense, os.path.join(tempfile.mkdtemp(dir="/var/tmp"), "tiny"))  # not under /tmp
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        defaults = json.load(f)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:  # the server's per-request defaults
        json.dump(dict(defaults, repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0, min_p=0.2,
                       temperature=0.6, top_k=20, top_p=0.95), f)
    try:
        engine = VLLMServerEngine(model_dir, torch.float32, max_model_len=128, retry_timeout_s=5,
                                  weight_transfer="gloo", transfer_senders=2, launch_prefix=prefix, launch_host=host,
                                  request_timeout_s=180)  # a group that cannot form fails in minutes, not 10
    except BaseException:
        shutil.rmtree(os.path.dirname(model_dir), ignore_errors=True)
        raise
    stage1 = {}

    def stage1_send(bucket):  # pipeline stage 1's rank: joins the group once, then sends its layers each push
        try:
            if "sender" not in stage1:  # not setdefault: its default would open a second group every push
                stage1["sender"] = GlooSender(engine.transfer.endpoint, 1)
            stage1["names"] = stage1["sender"].send_buckets([bucket])
        except BaseException as exc:  # noqa: BLE001
            stage1["names"] = exc

    def push(weights, version):
        items = list(weights.items())  # file order keeps each layer's tensors together
        split = next(i for i, (k, _) in enumerate(items) if k.startswith("model.layers.2."))
        other = threading.Thread(target=stage1_send, args=(items[split:],))
        other.start()
        names = engine.update_weights([items[:split]], version)
        other.join(timeout=300)
        assert isinstance(stage1["names"], list), stage1["names"]
        return names + stage1["names"]

    try:
        assert engine.url.startswith(f"http://{host}:") and engine.num_workers() == 1
        assert engine.transfer.endpoint.master_address == (host[:-1] + "1" if host != "127.0.0.1" else host)
        rollouts = engine.generate([[5, 6, 7], [8, 9], [5, 6, 7]], 2, Sampling(max_tokens=12, temperature=0.8, seed=1))
        assert len(rollouts) == 6 and all(len(r.logprobs) == len(r.completion_ids) > 0 for r in rollouts)
        assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1, 2, 2]
        # each (prompt, sample) its own seed (seed + p * n + i, the offline engine's): a prompt repeated in a
        # step draws another group (with one seed per sample over every prompt: the same group)
        groups = [[tuple(r.completion_ids) for r in rollouts.items[2 * p:2 * p + 2]] for p in range(3)]
        assert groups[0] != groups[2] and groups[0][0] != groups[0][1], groups
        # log_softmax(logits / T), the trainer's: none of the model's generation_config defaults (penalties,
        # min_p, top-k / top-p) reach the sampled distribution (with them: max |diff| 0.047 here)
        ref = _hf_completion_logprobs(tiny_dense, rollouts, torch.float32, 0.8)
        diffs = [abs(a - b) for r, row in zip(rollouts, ref) for a, b in zip(r.logprobs, row)]
        assert max(diffs) <= TOLERANCE[torch.float32][1], max(diffs)
        probe = ProbeBatch([rollouts.items[0].prompt_ids + rollouts.items[0].completion_ids], [3])
        before = engine.score(probe.sequences, probe.prompt_lens)
        original = load_file(os.path.join(tiny_dense, "model.safetensors"))
        results = []
        for version, scale in ((1, 1.05), (2, 0.9)):
            weights = {k: v * scale for k, v in original.items()}
            names = push(weights, version)
            assert sorted(names) == sorted(weights)
            expected = _hf_scores(tiny_dense, weights, probe.sequences, probe.prompt_lens)
            metrics = check_parity(engine, probe, lambda p: expected, names, 1e-4, version, max_tolerance=1e-3)
            assert metrics["sync/logprob_abs_diff_max"] < 1e-4  # the server follows the push
            assert check_weights(engine, version) >= 10  # norms + embeddings of stage 0: checksums equal ours
            results.append(engine.score(probe.sequences, probe.prompt_lens))
        assert engine.weight_version() == "2" and engine.policy_version == 2
        again = engine.generate([[5, 6, 7]], 1, Sampling(max_tokens=6, seed=1))
        assert again.items[0].policy_version == 2
        pairs = ((before, results[0]), (results[0], results[1]))
        moved = [max(abs(a - b) for a, b in zip(x[0], y[0])) for x, y in pairs]
        assert min(moved) > 1e-3, moved  # each push changed the log-probs (to the new weights: parity above)
        shm = SharedFileFanout(1)  # the file transport: the server cannot see this host's /dev/shm
        path = shm.publish([("model.norm.weight", original["model.norm.weight"])])[0]
        with pytest.raises(GeneratorError, match="/collective_rpc"):
            engine.push_file(path)  # its worker extension finds no such file in its own /dev/shm
        shm.close()
        os.killpg(engine._proc.pid, signal.SIGKILL)
        engine._proc.wait()
        with pytest.raises(GeneratorError, match=r"did not answer .* attempts over 5 s"):
            engine.generate([[5]], 1, Sampling(max_tokens=2))
    finally:
        if isinstance(stage1.get("sender"), GlooSender):
            stage1["sender"].close()
        engine.close()
        shutil.rmtree(os.path.dirname(model_dir), ignore_errors=True)


@pytest.mark.vllm
def test_llama_vllm_loads_takes_pushes_and_the_probe_catches_a_bad_one(tiny_llama):
    """vLLM serves the tiny Llama (no QK-norm, tied embeddings: the pushed ``lm_head.weight`` is the
    embedding's); after a push its log-probs follow the new weights and match ours; a push that drops a
    tensor fails the probe, a misnamed one is refused."""
    r0 = run_distributed(_push_worker, 1, tiny_llama, 1, "file")[0]
    assert isinstance(r0["good"], dict) and r0["good"]["sync/logprob_abs_diff_mean"] < 1e-4, r0["good"]
    assert r0["moved"] > 1e-2
    assert isinstance(r0["dropped"], str) and "failed the parity probe" in r0["dropped"]
    assert r0["misnamed"] is not None and "upp_proj" in r0["misnamed"]
