"""Reward registry and checks: wrong length, NaN or an exception name the function and the step."""

import pytest
import torch

from megatron_grpo.rewards import REWARDS, compute_rewards, get_reward_fn, negative_length


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


def uses_text(completion_ids, texts, **kwargs):
    return torch.tensor([float(len(t)) for t in texts])


@pytest.mark.parametrize("name, error, match", [
    ("tests.test_rewards:bad_length", ValueError, r"returned 1 rewards for 2 completions at step 7"),
    ("tests.test_rewards:with_nan", ValueError, r"non-finite rewards \(or beyond float32.s range\) at step 7"),
    ("tests.test_rewards:raises", RuntimeError, r"raised at step 7: KeyError"),
    ("tests.test_rewards:huge", ValueError, r"beyond float32's range\) at step 7"),
    ("tests.test_rewards:strings", ValueError, r"at step 7 returned a non-number for completion 0: '1.0'"),
    ("tests.test_rewards:a_dict", ValueError, r"at step 7 must return a list of numbers, got dict"),
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
