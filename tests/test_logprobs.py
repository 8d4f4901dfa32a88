"""token_log_probs against log_softmax(full_logits).gather, single-process and TP=2 (gloo)."""

import pytest
import torch

from megatron_grpo.parallel.logprobs import token_log_probs
from tests._dist import run_distributed


def _reference(logits, labels):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _data(dtype=torch.float32, shape=(3, 7), vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    return logits, labels


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 5, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference_values_and_gradients(chunk_size, dtype):
    logits, labels = _data(dtype)
    ours_in = logits.clone().requires_grad_(True)
    ref_in = logits.clone().requires_grad_(True)
    weights = torch.randn(labels.shape)
    ours = token_log_probs(ours_in, labels, chunk_size=chunk_size)
    ref = _reference(ref_in, labels)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    assert ours_in.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours_in.grad.float(), ref_in.grad.float(), atol=tol, rtol=0)


def test_does_not_modify_logits_and_entropy_is_correct():
    logits, labels = _data()
    before = logits.clone()
    lp, entropy = token_log_probs(logits, labels, chunk_size=4, return_entropy=True)
    assert torch.equal(logits, before)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy, -(probs * probs.log()).sum(-1), atol=1e-5, rtol=0)
    assert not entropy.requires_grad


def test_bad_inputs_are_value_errors():
    logits, labels = _data()
    with pytest.raises(ValueError, match="labels shape"):
        token_log_probs(logits, labels[:, :-1])
    with pytest.raises(ValueError, match="integer"):
        token_log_probs(logits, labels.float())
    with pytest.raises(ValueError, match="chunk_size"):
        token_log_probs(logits, labels, chunk_size=0)


def _tp_worker(dtype, chunk_size, temperature):
    import torch.distributed as dist

    from megatron_grpo.parallel import state

    state.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, labels = _data(dtype, shape=(4, 9), vocab=64, seed=3)
    labels[0, :4] = torch.tensor([0, 31, 32, 63])  # both shards' edges
    local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    lp, entropy = token_log_probs(local, labels, tp_group=dist.group.WORLD, chunk_size=chunk_size,
                                  temperature=temperature, return_entropy=True)
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    (lp * weights).sum().backward()
    return lp.detach(), local.grad.float(), entropy


@pytest.mark.parametrize("dtype, chunk_size, temperature", [(torch.float32, 5, 1.0), (torch.bfloat16, None, 0.7),
                                                            (torch.float16, 7, 1.3)])
def test_tensor_parallel_matches_full_vocab(dtype, chunk_size, temperature):
    """Each rank's vocabulary shard against log_softmax(fp32 logits / T) of the whole vocabulary: log-probs,
    entropy and the gradient, at T != 1 too."""
    results = run_distributed(_tp_worker, 2, dtype, chunk_size, temperature)
    logits, labels = _data(dtype, shape=(4, 9), vocab=64, seed=3)
    labels[0, :4] = torch.tensor([0, 31, 32, 63])
    full = logits.float().clone().requires_grad_(True)
    full_lp = torch.log_softmax(full / temperature, -1)
    ref = full_lp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    (ref * weights).sum().backward()
    grad = torch.cat([g for _, g, _ in results], dim=-1)
    for lp, _, entropy in results:
        torch.testing.assert_close(lp, ref.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, -(full_lp.exp() * full_lp).sum(-1).detach(), atol=1e-5, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad, full.grad, atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_temperature_is_applied_after_the_fp32_cast(dtype):
    """vLLM and the write-up divide fp32 logits by T; dividing the bf16 logits first rounds them
    again (T = 0.7: mean |d logp| ~ 0.045 on real models)."""
    logits, labels = _data(dtype, shape=(4, 16), vocab=300)
    t = 0.7
    exact = torch.log_softmax(logits.float() / t, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ours_in = logits.clone().requires_grad_(True)
    ours = token_log_probs(ours_in, labels, temperature=t, chunk_size=5)
    torch.testing.assert_close(ours, exact, atol=2e-6, rtol=0)
    rounded = _reference(logits / t, labels)  # the old path: T applied in the low precision
    assert (rounded - exact).abs().max() > 1e-3
    ref_in = logits.float().clone().requires_grad_(True)
    torch.log_softmax(ref_in / t, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1).sum().backward()
    ours.sum().backward()
    torch.testing.assert_close(ours_in.grad.float(), ref_in.grad, atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(logits, labels, temperature=0.0)
