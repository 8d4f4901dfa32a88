"""tools/cluster/grpo.sbatch: its #SBATCH directives (the only part Slurm reads as text), and the script
itself run by bash with a fake ``srun`` (records its options, runs its command line with SLURM_* set),
``scontrol`` (names the allocation's hosts, records requeues) and, where the run's behaviour is not the
point, ``torchrun`` (records its command line and the environment the ranks get): the rendezvous on
the first node, a requeued start resuming, bad input stopping before srun; the real torchrun line
trains the tiny job, a USR1 (the time-limit warning) checkpoints, exits 75 and requeues, the requeued
start resumes; a SIGTERM (scancel) checkpoints without a requeue."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from megatron_grpo.observe.metrics_logger import read_metrics_rows
from tests._dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "tools", "cluster", "grpo.sbatch")
RECIPE = os.path.join(ROOT, "recipes", "grpo-tiny-eos-cpu.yaml")
JOB_ID = "4242"
FAKE_SRUN = """#!/bin/bash
# srun on one node: record srun's options, run the command line as task 0 of node 0
options=()
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do options+=("$1"); shift; done
echo "${options[*]}" > "$FAKE_SLURM_LOG.srun"
export SLURM_PROCID=0 SLURM_NODEID=0 SLURM_LOCALID=0 SLURM_STEP_ID=0 SLURM_NTASKS=1
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
case "$1 $2" in
    "show hostnames") printf '%s\n' ${FAKE_HOSTNAMES-localhost} ;;  # the allocation's hosts, one a line
    "requeue "*) ;;
    *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""
FAKE_TORCHRUN = """#!/bin/bash
# a rank that stops at SIGTERM as ours does: exits FAKE_EXIT at once, or 75 when signalled
env | grep -E '^(GLOO_SOCKET_IFNAME|NCCL_SOCKET_IFNAME|TORCH_ELASTIC_SHUTDOWN_TIMEOUT|TORCH_NCCL_ASYNC_\\w+)=' \\
    | sort > "$FAKE_SLURM_LOG.env"  # what the ranks inherit
[ -n "${FAKE_EXIT:-}" ] && { echo "$*" > "$FAKE_SLURM_LOG.torchrun"; exit "$FAKE_EXIT"; }
trap 'exit 75' TERM
echo "$*" > "$FAKE_SLURM_LOG.torchrun"  # after the trap: the test signals once this file exists
sleep 60 & wait
"""


def directives(path=SBATCH):
    """``{option: value}`` of the #SBATCH lines (value None for a flag); sbatch reads them only up to the
    first command, so a directive after it is an error here."""
    found, commands_seen = {}, False
    for line in open(path):
        line = line.strip()
        if line.startswith("#SBATCH"):
            assert not commands_seen, f"sbatch ignores a directive after the first command: {line}"
            option, _, value = line.split(None, 1)[1].partition("=")
            found[option] = value or None
        elif line and not line.startswith("#"):
            commands_seen = True
    return found


def _slurm(tmp_path, fakes, **extra):
    """The fake Slurm: a bin folder with ``fakes`` ({name: script}) first on PATH, the job's SLURM_* env."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GLOO_", "NCCL_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), env["PATH"]]),
               SLURM_JOB_ID=JOB_ID, SLURM_JOB_NODELIST="node1", SLURM_NNODES="1", GPUS_PER_NODE="1",
               RDZV_PORT=str(free_port()), OMP_NUM_THREADS="1", FAKE_SLURM_LOG=str(tmp_path / "slurm.log"))
    env.update({k: v for k, v in extra.items() if v is not None})
    for k in [k for k, v in extra.items() if v is None]:  # None: unset
        env.pop(k, None)
    return env


def _calls(tmp_path, suffix=""):
    path = tmp_path / f"slurm.log{suffix}"
    return path.read_text().splitlines() if path.exists() else []


def test_directives_request_one_task_per_node_requeue_and_an_early_signal():
    d = directives()
    assert d["--ntasks-per-node"] == "1" and "--requeue" in d and d["--open-mode"] == "append"
    target, _, lead = d["--signal"].partition("@")
    assert target == "B:USR1" and int(lead) > 110  # the batch shell gets it, > torchrun's shutdown timeout


def _sbatch(tmp_path, args, **env):
    """One start of the script with fake srun, scontrol and torchrun (exits 0): (process, srun's options,
    torchrun's arguments, the ranks' environment), None where that program was not run."""
    for suffix in (".srun", ".torchrun", ".env"):
        (tmp_path / f"slurm.log{suffix}").unlink(missing_ok=True)
    fakes = {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "torchrun": FAKE_TORCHRUN}
    proc = subprocess.run(["bash", SBATCH, RECIPE] + args, env=_slurm(tmp_path, fakes, FAKE_EXIT="0", **env),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    logged = [_calls(tmp_path, suffix) for suffix in (".srun", ".torchrun", ".env")]
    return (proc, *(lines or None for lines in logged))


def test_two_nodes_meet_on_the_first_and_a_requeued_start_resumes(tmp_path):
    """A 2-node allocation: srun starts one torchrun per node with the submitting environment; torchrun
    meets on the first host ``scontrol show hostnames`` names, with the node count, the node's GPUs
    (SLURM_GPUS_ON_NODE), the job id and the join timeout; the interface variables and the shutdown
    timeout reach the ranks. A requeued start (SLURM_RESTART_COUNT=1) adds ``checkpointing.resume=true``
    where the recipe checkpoints, and warns where it does not; a bad recipe key and an empty host list stop
    the script (exit 2) before srun."""
    ckpt = f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"
    cluster = dict(FAKE_HOSTNAMES="nodeB nodeA", SLURM_JOB_NODELIST="node[A-B]", SLURM_NNODES="2", GPUS_PER_NODE=None,
                   SLURM_GPUS_ON_NODE="4", SLURM_RESTART_COUNT="1", GLOO_SOCKET_IFNAME="ib0", SHUTDOWN_TIMEOUT="50",
                   RDZV_TIMEOUT="60", RDZV_PORT="29555")
    proc, srun, torchrun, ranks_env = _sbatch(tmp_path, ["grpo.max_num_steps=3", ckpt], **cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert srun == ["--export=ALL --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1"]
    argv = shlex.split(torchrun[0])
    assert argv == ["--nnodes", "2", "--nproc-per-node", "4", "--max-restarts", "0", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "nodeB:29555", "--rdzv-id", JOB_ID, "--rdzv-conf", "join_timeout=60", "-m",
                    "megatron_grpo", "train", RECIPE, "grpo.max_num_steps=3", ckpt, "checkpointing.resume=true"]
    assert ranks_env == ["GLOO_SOCKET_IFNAME=ib0", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=50",
                         "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"]
    assert "2 nodes x 4, rendezvous nodeB:29555, GLOO_SOCKET_IFNAME=ib0" in proc.stdout
    proc, _, torchrun, _ = _sbatch(tmp_path, ["grpo.max_num_steps=3"], **cluster)  # nothing to resume from
    assert proc.returncode == 0 and shlex.split(torchrun[0])[-1] == "grpo.max_num_steps=3"
    assert "no checkpointing.checkpoint_dir: a preempted run cannot resume" in proc.stderr
    proc, srun, torchrun, _ = _sbatch(tmp_path, ["grpo.no_such_key=1"], **cluster)
    assert proc.returncode == 2 and "grpo.no_such_key" in proc.stderr and srun is torchrun is None
    proc, srun, _, _ = _sbatch(tmp_path, [], **dict(cluster, FAKE_HOSTNAMES=""))
    assert proc.returncode == 2 and "error: no host in SLURM_JOB_NODELIST=node[A-B]" in proc.stderr and srun is None


def test_command_line_and_exit_75_requeues_but_a_cancel_does_not(tmp_path):
    fakes = {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "torchrun": FAKE_TORCHRUN}
    args = ["bash", SBATCH, RECIPE, "grpo.max_num_steps=3", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]
    env = _slurm(tmp_path, fakes, FAKE_EXIT="75")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert _calls(tmp_path) == ["scontrol show hostnames node1", f"scontrol requeue {JOB_ID}"]
    torchrun = shlex.split(_calls(tmp_path, ".torchrun")[0])
    assert torchrun[:torchrun.index("-m")] == [
        "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"localhost:{env['RDZV_PORT']}", "--rdzv-id", JOB_ID, "--rdzv-conf", "join_timeout=900"]
    assert torchrun[torchrun.index("-m"):] == ["-m", "megatron_grpo", "train"] + args[2:]
    (tmp_path / "slurm.log").unlink()
    proc = subprocess.run(args, env=dict(env, FAKE_EXIT="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and _calls(tmp_path) == ["scontrol show hostnames node1"]  # an error: no requeue
    # USR1 (--signal=B:USR1) reaches the batch shell alone; scancel's SIGTERM reaches every process of the
    # job at once, so the ranks exit while the script's trap is still running (a slow `date` there): the
    # script must still report the ranks' 75, not its own interrupted wait's 143
    (tmp_path / "fake-bin" / "date").write_text('#!/bin/bash\nsleep 0.3\nexec /bin/date "$@"\n')
    (tmp_path / "fake-bin" / "date").chmod(0o755)
    for sig, requeued in ((signal.SIGUSR1, True), (signal.SIGTERM, False)):
        (tmp_path / "slurm.log").unlink()
        (tmp_path / "slurm.log.torchrun").unlink()
        batch = subprocess.Popen(args, env=dict(env, FAKE_EXIT=""), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        _wait_for(lambda: (tmp_path / "slurm.log.torchrun").exists(), batch)  # both traps are set
        if sig == signal.SIGTERM:
            os.killpg(batch.pid, sig)
        else:
            batch.send_signal(sig)
        assert batch.wait(timeout=60) == 75, batch.stdout.read()
        assert (f"scontrol requeue {JOB_ID}" in _calls(tmp_path)) == requeued, sig


def _wait_for(condition, proc, timeout=600):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} early: {proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _rows(log_dir):
    """The complete rows (read while the run may still write: ``read_metrics_rows`` drops a torn last line)."""
    path = os.path.join(log_dir, "metrics.jsonl")
    return read_metrics_rows(path) if os.path.isfile(path) else []


def test_real_run_usr1_checkpoints_exits_75_requeues_and_the_requeued_start_resumes(tmp_path, tiny_dense):
    """The real torchrun line, 1 node x 1 rank, megatron generator: USR1 after step 1 stops the run with a
    checkpoint (torchrun exits 1: the run's summary.json tells the script it was a signal) -> 75 and a
    requeue; the requeued start (SLURM_RESTART_COUNT=1) resumes and finishes. Steps enough that the signal
    (forwarded within the script's 1 s poll) lands before the last one (CI ran 4 tiny steps in 1 s)."""
    steps, log_dir = 30, str(tmp_path / "run")
    args = ["bash", SBATCH, RECIPE, f"policy.model_name={tiny_dense}", "generation.backend=megatron",
            "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=8", "grpo.deployed_improvement=false",
            f"grpo.max_num_steps={steps}", f"logger.log_dir={log_dir}", "logger.progress_bar=false",
            "logger.tensorboard=false", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]
    env = _slurm(tmp_path, {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL})
    out = open(tmp_path / "first.out", "w+")
    batch = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                             start_new_session=True)
    try:
        _wait_for(lambda: len(_rows(log_dir)) >= 1, batch)
        batch.send_signal(signal.SIGUSR1)
        code = batch.wait(timeout=600)
    finally:
        if batch.poll() is None:  # a failed test leaves no torchrun or rank behind (CPU, the rendezvous port)
            os.killpg(batch.pid, signal.SIGKILL)
    out.seek(0)
    assert code == 75, out.read()[-4000:]
    assert _calls(tmp_path)[-1] == f"scontrol requeue {JOB_ID}"
    stopped_at = len(_rows(log_dir))
    assert 1 <= stopped_at < steps
    assert json.load(open(os.path.join(log_dir, "summary.json")))["stopped"] == "signal"
    proc = subprocess.run(args, env=dict(env, SLURM_RESTART_COUNT="1"), capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert [r["step"] for r in _rows(log_dir)] == list(range(1, steps + 1))
    assert _calls(tmp_path).count(f"scontrol requeue {JOB_ID}") == 1  # the finished start is not requeued
    assert f"(step {stopped_at}, policy version" in proc.stdout + proc.stderr  # "resumed from ... (step N, ..."
