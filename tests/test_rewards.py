"""Reward registry and checks: wrong length, NaN or an exception name the function and the step."""

import pytest
import torch

from megatron_grpo.trainer.rewards import REWARDS, compute_rewards, get_reward_fn, negative_length


def test_negative_length():
    assert negative_length([[1, 2, 3], [4]]) == [-3.0, -1.0]
    assert get_reward_fn("negative_length") is negative_length


def bad_length(completion_ids, **kwargs):
    return [1.0]


def with_nan(completion_ids, **kwargs):
    return [float("nan")] * len(completion_ids)


def raises(completion_ids, **kwargs):
    raise KeyError("boom")


def huge(completion_ids, **kwargs):
    return [1e300] * len(completion_ids)


def strings(completion_ids, **kwargs):
    return ["1.0"] * len(completion_ids)


def a_dict(completion_ids, **kwargs):
    return {"a": 1.0, "b": 2.0}


def hangs(completion_ids, **kwargs):
    import time

    time.sleep(30)


def scalar_array(completion_ids, **kwargs):
    import numpy as np

    return np.array(1.0)  # a 0-d array: has __len__, but len() raises TypeError


def uses_text(completion_ids, texts, **kwargs):
    return torch.tensor([float(len(t)) for t in texts])


@pytest.mark.parametrize("name, error, match", [
    ("tests.test_rewards:bad_length", ValueError, r"returned 1 rewards for 2 completions at step 7"),
    ("tests.test_rewards:with_nan", ValueError, r"non-finite rewards \(or beyond float32.s range\) at step 7"),
    ("tests.test_rewards:raises", RuntimeError, r"raised at step 7: KeyError"),
    ("tests.test_rewards:huge", ValueError, r"beyond float32's range\) at step 7"),
    ("tests.test_rewards:strings", ValueError, r"at step 7 returned a non-number for completion 0: '1.0'"),
    ("tests.test_rewards:a_dict", ValueError, r"at step 7 must return a list of numbers .*, got dict"),
    ("tests.test_rewards:scalar_array", ValueError, r"at step 7 must return a list of numbers .*, got ndarray of shape \(\)"),
    ("tests.test_rewards:hangs", RuntimeError, r"did not return within reward.timeout_s=0.5 s at step 7"),
])
def test_bad_rewards_name_function_and_step(name, error, match):
    with pytest.raises(error, match=match) as err:
        compute_rewards(get_reward_fn(name), name, 7, [[1], [2, 3]], ["a", "bc"], [[0], [0]], timeout_s=0.5)
    assert name in str(err.value)


def test_user_reward_by_dotted_path_gets_texts():
    fn = get_reward_fn("tests.test_rewards:uses_text")
    out = compute_rewards(fn, "uses_text", 1, [[1], [2, 3]], ["a", "bcd"], [[0], [0]])
    assert out.tolist() == [1.0, 3.0]


def test_unknown_reward_lists_valid_names():
    with pytest.raises(ValueError, match="negative_length"):
        get_reward_fn("nope")
    assert "negative_length" in REWARDS.names()


def counted(completion_ids, texts, **kwargs):
    """Records which rank called it (a reward with side effects: a service, a sandbox, a counter)."""
    import os

    with open(os.environ["REWARD_CALLS"], "a") as f:
        f.write(os.environ["RANK"] + "\n")
    return [float(len(t)) for t in texts]


def _score_on_two_ranks(calls_file):
    """Each rank scores the same rollouts (rank 1 with a decode that would fail), then a NaN reward,
    then waits on a collective that rank 0 joins too late for the configured timeout."""
    import os
    import time

    import torch.distributed as dist

    from megatron_grpo.parallel import comm, cpu, state
    from megatron_grpo.trainer.rewards import score_once

    from tests._dist import file_barrier

    os.environ["REWARD_CALLS"] = calls_file
    cpu.install()
    file_barrier()  # the 2 s timeout also bounds the rendezvous: start it with both ranks' imports done
    state.init_distributed(timeout_minutes=2.0 / 60)  # cluster.distributed_timeout_minutes: 2 s
    rank = dist.get_rank()
    decode = (lambda ids: ["x" * len(i) for i in ids]) if rank == 0 else None  # other ranks never decode
    ok = score_once(get_reward_fn("tests.test_rewards:counted"), "counted", 3, [[1], [2, 3]], decode, [[0], [0]],
                    rank=rank)
    try:
        score_once(with_nan, "with_nan", 4, [[1], [2, 3]], decode, [[0], [0]], rank=rank)
        error = None
    except ValueError as exc:
        error = str(exc)
    try:  # rank 0 fails outside the reward (its tokenizer): every rank gets the error, none waits it out
        score_once(counted, "counted", 5, [[1]], lambda ids: [ids[0].decode()], [[0]], rank=rank)
        decode_error = None
    except RuntimeError as exc:
        decode_error = str(exc)
    if rank == 0:
        time.sleep(6.0)  # e.g. a vLLM start on rank 0 that outlasts the collective timeout
    started = time.monotonic()
    try:
        comm.broadcast_object("late", src=0)
        timed_out = False
    except Exception:  # noqa: BLE001 - gloo raises RuntimeError on a timed-out collective
        timed_out = True
    return ok.tolist(), error, timed_out, time.monotonic() - started, decode_error


def test_rewards_scored_once_broadcast_and_agreed_with_the_collective_timeout(tmp_path):
    """Rank 0 alone calls the reward; every rank gets its values, or the same error naming function and step;
    ``cluster.distributed_timeout_minutes`` bounds how long a rank waits in a collective."""
    from tests._dist import run_distributed

    calls = tmp_path / "calls.txt"
    results = run_distributed(_score_on_two_ranks, 2, str(calls))
    assert calls.read_text().split() == ["0"]  # one call, on rank 0
    assert [r[0] for r in results] == [[1.0, 2.0]] * 2
    assert results[0][1] == results[1][1] and "'with_nan'" in results[1][1] and "at step 4" in results[1][1]
    assert results[1][2] and results[1][3] < 5.0  # rank 1 gave up after ~2 s, not the 30-minute default
    assert results[0][4] == results[1][4] and "'counted' failed at step 5: AttributeError" in results[1][4]


def test_agreed_timeout_defaults_below_the_collective_timeout():
    """Unset ``reward.timeout_s`` with several ranks: rank 0 gives up (and tells every rank) before the others'
    collective times out; one process keeps no limit; a set value wins."""
    from megatron_grpo.trainer.rewards import agreed_timeout_s

    assert agreed_timeout_s(None, 30.0, 1) is None
    assert agreed_timeout_s(None, 30.0, 8) == pytest.approx(0.9 * 1800)
    assert agreed_timeout_s(12.0, 30.0, 8) == 12.0
