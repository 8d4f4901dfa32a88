"""``torchrun --nnodes 2`` across two hosts as ``tools/cluster/grpo.sbatch`` launches it: two network
namespaces joined by a veth pair (node 0 at 10.232.0.1, node 1 at 10.232.0.2), each with its own
hostname that it resolves to 127.0.1.1 itself (a Debian/Ubuntu node's ``/etc/hosts``), c10d rendezvous on
node 0's hostname (``--rdzv-endpoint HEAD:PORT``), no interface variable set by hand. torchrun then sets
``MASTER_ADDR`` to the head's hostname: node 1's gloo must bind its address on the route to it, the
head's the interface of its default route (``parallel/net.py``); left to itself gloo binds the
hostname's loopback address. Where network namespaces cannot be made (not root), both nodes run on
127.0.0.1 (warned, not skipped)."""

import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

from megatron_grpo.observe.metrics_logger import read_metrics_rows

from tests._dist import free_port
from tests._netns import Host, veth_hosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml")
STEPS = 3
VOLATILE = ("time/", "timing/")
"""Wall times: the only metrics a layout on other hosts may change."""
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
FAIL_FAST_GRACE_S = 60
"""After a launcher fails, the time the others get to end before they are killed: a node whose peer died
(e.g. a rank aborting at exit) would otherwise wait out torchrun's exit barrier or the launch timeout."""
CLEAN_EXIT = "process groups destroyed: no gloo worker thread left"
"""What each rank logs once its process groups are freed before exit (``parallel/state.py`` ``shutdown``)."""


def _common(model_dir):
    return [f"policy.model_name={model_dir}", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=8",
            "grpo.deployed_improvement=false", "logger.progress_bar=false", "logger.tensorboard=false"]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in INTERFACE_VARIABLES + LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"  # 2 shared cores: one thread per rank
    return env


def _rows(log_dir):
    """The complete rows (read while the run may still write: ``read_metrics_rows`` drops a torn last line)."""
    path = os.path.join(log_dir, "metrics.jsonl")
    return read_metrics_rows(path) if os.path.isfile(path) else []


def _wait_all(procs, timeout, grace=FAIL_FAST_GRACE_S):
    """Exit codes. Once a launcher has failed the others get ``grace`` more seconds; past that, or past
    ``timeout``, every launcher still running is killed with its process group (its workers with it)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return [p.wait() for p in procs]


def launch(hosts, args, log_dir, nproc_per_node=1, timeout=600):
    """``megatron-grpo train`` under ``torchrun --nnodes len(hosts)``, one launcher per host, c10d
    rendezvous on host 0 (by hostname where hosts have one: the head ranks first, names sort so);
    returns (exit codes, each node's output, metrics rows)."""
    os.makedirs(log_dir, exist_ok=True)
    port = "29500" if hosts[0].prefix else str(free_port())  # a fresh namespace has every port free
    procs, logs = [], []
    for i, host in enumerate(hosts):
        cmd = host.prefix + [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
                             "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0", "--rdzv-backend",
                             "c10d", "--rdzv-endpoint", f"{hosts[0].reach}:{port}", "--rdzv-id", "multinode-test",
                             "-m", "megatron_grpo", "train", RECIPE, f"logger.log_dir={log_dir}"] + list(args)
        logs.append(open(os.path.join(log_dir, f"node{i}.log"), "a"))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=logs[-1], stderr=subprocess.STDOUT,
                                      start_new_session=True))
    codes = _wait_all(procs, timeout)
    for f in logs:
        f.close()
    outs = [open(os.path.join(log_dir, f"node{i}.log")).read() for i in range(len(hosts))]
    return codes, outs, _rows(log_dir)


def one_host(args, log_dir, nproc=2, timeout=600):
    """The same job on one host: ``torchrun --nproc-per-node nproc`` on loopback."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), "-m", "megatron_grpo", "train", RECIPE, f"logger.log_dir={log_dir}"] + list(args)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, _rows(log_dir)


def assert_rows_equal(rows, reference, abs_tol=1e-6, rel_tol=1e-6, names=None):
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for row, ref in zip(rows, reference):
        keys = names or [k for k in ref if not k.startswith(VOLATILE) and isinstance(ref[k], (int, float))]
        for name in keys:
            assert row[name] == pytest.approx(ref[name], abs=abs_tol, rel=rel_tol), (row["step"], name)


def test_a_launcher_that_dies_ends_the_wait_for_the_others():
    """A rank aborting at exit fails its node's launcher at once; the other node's launcher (which
    would wait out torchrun's exit barrier) is killed after the grace, not after the launch timeout."""
    waiting = subprocess.Popen(["sleep", "60"], start_new_session=True)
    dying = subprocess.Popen([sys.executable, "-c", "import os; os.abort()"], start_new_session=True)
    started = time.monotonic()
    assert _wait_all([waiting, dying], timeout=600, grace=1) == [-signal.SIGKILL, -signal.SIGABRT]
    assert time.monotonic() - started < 30


@pytest.fixture(scope="module")
def two_hosts():
    """Node 0 and node 1: two network namespaces (``mgb<pid>n0``, host ``mgb<pid>h0`` at 10.232.0.1;
    ``mgb<pid>n1``, host ``mgb<pid>h1`` at 10.232.0.2), or both on 127.0.0.1 where namespaces cannot be made."""
    with veth_hosts("mgb", "10.232.0", named=True) as hosts:
        if hosts is None:
            warnings.warn("the two nodes run on 127.0.0.1 (no network namespaces): gloo's binding is not tested")
            hosts = [Host([], "127.0.0.1"), Host([], "127.0.0.1")]
        yield hosts


@pytest.fixture(scope="module")
def megatron_runs(two_hosts, tiny_dense, tmp_path_factory):
    """DP=2 with the megatron generator and token-budget micro-batches (sequences balanced over the DP
    ranks by tokens): one host for STEPS steps; two nodes for STEPS - 1 steps with a checkpoint, then a
    second launch on both nodes resuming it to STEPS."""
    common = _common(tiny_dense) + ["generation.backend=megatron", f"grpo.max_num_steps={STEPS}",
                                    "policy.dynamic_batching.enabled=true",
                                    "policy.dynamic_batching.max_tokens_per_microbatch=96"]
    code, out, reference = one_host(common, str(tmp_path_factory.mktemp("one-host")))
    assert code == 0, out[-4000:]
    log_dir, ckpt = str(tmp_path_factory.mktemp("two-nodes")), str(tmp_path_factory.mktemp("ckpt"))
    saved = common + [f"checkpointing.checkpoint_dir={ckpt}"]
    first = launch(two_hosts, saved + [f"grpo.max_num_steps={STEPS - 1}"], log_dir)
    second = launch(two_hosts, saved + ["checkpointing.resume=true"], log_dir)
    return reference, first, second


def test_two_nodes_train_save_and_resume_equal_one_host(two_hosts, megatron_runs):
    reference, (codes, outs, rows), (resumed_codes, resumed_outs, resumed_rows) = megatron_runs
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert [r["step"] for r in rows] == list(range(1, STEPS))
    assert resumed_codes == [0, 0], "\n".join(o[-3000:] for o in resumed_outs)
    assert_rows_equal(resumed_rows, reference)  # 1 .. STEPS - 1 from the first launch, STEPS after the resume
    for r in reference + rows + resumed_rows:  # the generator scored in the step's layout: the trainer's log-probs
        assert r["precision/alpha_abs_mean"] == 0.0 and r["sync/logprob_abs_diff_max"] == 0.0, r["step"]
    for launches, node_outs in enumerate((outs, resumed_outs), start=1):  # each launch appends to node<i>.log
        for out in node_outs:  # every rank freed its process groups before exiting (no abort at exit)
            assert out.count(CLEAN_EXIT) == launches, out[-3000:]
    if two_hosts[0].prefix:  # each node bound gloo to its end of the veth pair: node 1 on the route to the
        for i, out in enumerate(outs + resumed_outs):  # head's name, the head (loopback there) its default route's
            where = ("its default route: MASTER_ADDR=mgb{}h0 is loopback here, the head node" if i % 2 == 0 else
                     "the route to MASTER_ADDR=mgb{}h0").format(os.getpid())
            assert f"gloo binds to mgb{os.getpid()}v{i % 2} (10.232.0.{i % 2 + 1}, this node's address on {where})" \
                in out, out[-3000:]


@pytest.mark.vllm
def test_two_nodes_with_the_vllm_generator_on_node_0(two_hosts, tiny_dense, tmp_path):
    """The vLLM engine runs in rank 0's process on node 0; node 1's rank trains with it."""
    args = _common(tiny_dense) + ["generation.backend=vllm", "grpo.max_num_steps=1"]
    codes, outs, rows = launch(two_hosts, args, str(tmp_path))
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["sync/logprob_abs_diff_max"] < 1e-4  # fp32 trainer and fp32 vLLM agree after the push
    assert all(out.count(CLEAN_EXIT) == 1 for out in outs), "\n".join(o[-3000:] for o in outs)


@pytest.mark.slow
def test_four_ranks_tp2_inside_each_node_dp2_across(two_hosts, tiny_dense, megatron_runs, tmp_path):
    """2 nodes x 2 ranks: TP=2 inside a node, DP=2 across the nodes; the steps equal the one-host DP=2
    run's up to TP's GEMM round-off."""
    reference = megatron_runs[0]
    args = _common(tiny_dense) + ["generation.backend=megatron", "grpo.max_num_steps=2",
                                  "policy.megatron_cfg.tensor_model_parallel_size=2"]
    codes, outs, rows = launch(two_hosts, args, str(tmp_path), nproc_per_node=2)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert all(out.count(CLEAN_EXIT) == 2 for out in outs), "\n".join(o[-3000:] for o in outs)  # 2 ranks a node
    assert_rows_equal(rows, reference[:2], abs_tol=1e-5, rel_tol=1e-4,
                      names=["loss/policy", "reward/mean", "completion/length_mean", "train/grad_norm"])
