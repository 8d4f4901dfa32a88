"""Megatron DDP + finalize_model_grads: reduced gradients and Megatron's global grad norm of
expert/expert-tensor parallel layouts equal one process's, parameter by parameter (gathered to HF
names)."""

import pytest
import torch

from tests._dist import run_distributed

ROWS, SEQ = 8, 24


def _reduced_grads(model_dir, layout):
    """This rank's share of one step's batch -> forward-backward -> reduce; returns the full
    gradient under HF names (shards gathered like weights) and the global grad norm."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
    from megatron_grpo.models.weights import export_hf_tensors
    from megatron_grpo.parallel import state
    from tests.test_routing import _step_batch, _stepper

    state.initialize_model_parallel(layout)
    st = _stepper(model_dir)
    st.tp_group, st.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    st.current_step, st.nonfinite = 0, []
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(rank * ROWS // dp, (rank + 1) * ROWS // dp)
    old, adv = torch.full((ROWS, SEQ), -7.0), torch.linspace(-1.0, 1.0, ROWS)
    st.optimizer.zero_grad()
    st.forward_backward(_step_batch(old, adv, rows=rows), None, None)
    st.optimizer.megatron.prepare_grads()
    norm = torch.tensor(st.optimizer.megatron.get_grad_norm())
    with torch.no_grad():
        for p in st.optimizer.params:
            p.copy_(p.main_grad)
    shape = shape_from_hf(load_hf_config(st.cfg.policy.model_name))
    out = {k: v.clone() for k, v in export_hf_tensors(st.model, shape, include_tied_lm_head=False)}
    return out, norm, dist.get_world_size()


def _worker(model_dir, ep, etp):
    from megatron_grpo.parallel.state import Layout

    return _reduced_grads(model_dir, Layout(world_size=ep * etp, ep=ep, etp=etp))


@pytest.mark.parametrize("ep, etp", [(2, 1), (1, 2)], ids=["ep2", "etp2"])
def test_expert_parallel_gradients_match_one_process(ep, etp, tiny_moe):
    (ref, ref_norm, _), = run_distributed(_worker, 1, tiny_moe, 1, 1)
    for grads, norm, _ in run_distributed(_worker, 2, tiny_moe, ep, etp):
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
        for name, g in ref.items():
            err = ((grads[name] - g).norm() / g.norm().clamp(min=1e-30)).item()
            assert err < 1e-5, (name, err)
