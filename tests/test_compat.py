"""One test per shim of ``megatron_grpo.compat`` against the installed Megatron-Core / vLLM (CI runs
both lanes: 0.16.1 and 0.19.x; the vLLM shims skip where vLLM is not installed), the import-cost
promises of the compat modules, and pyproject's pins (no open-ended range for what we reach into)."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

from megatron_grpo.compat import megatron as mc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- megatron-core -----------------------------------------------------------------------------------------


def test_version_is_the_installed_megatron_core():
    from megatron.core import package_info

    assert mc.version() == (package_info.MAJOR, package_info.MINOR, package_info.PATCH)
    assert mc.version() == (0, 16, 1) if sys.version_info < (3, 12) else (0, 16, 1) <= mc.version() < (0, 20, 0)


def test_cuda_factory_modules_have_a_module_level_torch():
    modules = mc.cuda_factory_modules()
    assert [m.__name__ for m in modules] == list(mc.MODULES_WITH_CUDA_FACTORIES)
    assert all(hasattr(m, "torch") for m in modules)  # what the CPU shims replace


def test_te_general_gemm_is_bound_in_the_moe_modules():
    import importlib

    mc.define_missing_te_general_gemm()
    for name in ("megatron.core.transformer.moe.router", "megatron.core.transformer.moe.moe_utils"):
        assert hasattr(importlib.import_module(name), "te_general_gemm")


def test_local_layer_spec_has_the_qwen3_parts():
    spec = mc.gpt_layer_spec(use_te=False, num_experts=None)
    layer = spec.submodules
    assert layer.input_layernorm is not None and layer.self_attention.submodules.q_layernorm is not None
    moe = mc.gpt_layer_spec(use_te=False, num_experts=4).submodules.mlp
    assert "MoE" in getattr(moe, "module", getattr(moe, "func", None)).__name__  # 0.19: a partial, not a ModuleSpec


def test_gpt_model_builds_and_keeps_its_kv_cache_per_layer(tiny_dense, megatron_single):
    """``gpt_model`` (through ``build_from_hf``), then one KV-cached forward in a
    ``static_inference_context``, whose cache ``keep_kv_rows`` thins."""
    from megatron_grpo.models import build_from_hf

    model, _ = build_from_hf(tiny_dense)
    assert type(model).__name__ == "GPTModel"
    ids = torch.randint(3, 100, (3, 5), generator=torch.Generator().manual_seed(0))
    context = mc.static_inference_context(3, 8)
    model.eval()
    with torch.no_grad():
        model(ids, torch.arange(5).expand_as(ids), None, inference_context=context, runtime_gather_output=True)
    layers = context.key_value_memory_dict
    assert sorted(layers) == list(range(1, model.config.num_layers + 1))
    key, value = layers[1]
    assert key.shape[:2] == (8, 3) and value.shape[:2] == (8, 3)  # [max seq, batch, heads, dim]
    mc.keep_kv_rows(context, [0, 2])
    assert all(k.shape[1] == 2 and v.shape[1] == 2 for k, v in layers.values())
    # only the 5 positions written are compared: the cache is allocated with torch.empty, so the rest is
    # whatever memory held (NaN != NaN made this flaky on lane 2)
    assert torch.equal(layers[1][0][:5], key[:5, [0, 2]]) and torch.equal(layers[1][1][:5], value[:5, [0, 2]])


def test_distributed_optimizer_ranges_cover_every_param_once(tiny_dense, megatron_single):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_grpo.checkpoint import sharded_state
    from tests.test_routing import _stepper

    st = _stepper(tiny_dense, "policy.megatron_cfg.optimizer.use_distributed_optimizer=true")
    opts = [o for o in sharded_state.chained(st.optimizer.megatron) if isinstance(o, DistributedOptimizer)]
    assert opts
    ranges = [r for opt in opts for r in mc.distributed_optimizer_ranges(opt)]
    params = [p for p in st.model.parameters() if p.requires_grad]
    assert len(ranges) == len(params) and {id(r[0]) for r in ranges} == {id(p) for p in params}
    for model_param, main, start, end in ranges:  # DP = 1: each rank owns every parameter whole
        assert (start, end) == (0, model_param.numel()) and main.numel() == model_param.numel()


def _groups_left_after_destroy():
    """(group globals ``destroy_model_parallel`` leaves set, those the shim leaves set), in a fresh world."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.parallel.state import Layout, initialize_model_parallel

    def groups_set():
        return sorted(n for n, v in vars(ps).items() if isinstance(v, torch.distributed.ProcessGroup))

    initialize_model_parallel(Layout(world_size=1))
    ps.destroy_model_parallel()
    forgotten = groups_set()
    initialize_model_parallel(Layout(world_size=1))
    mc.destroy_model_parallel()
    return forgotten, groups_set()


def test_destroy_model_parallel_leaves_no_group_set():
    """Megatron's own teardown forgets exactly ``LEFT_SET_BY_DESTROY`` (the shim is still needed where
    it does); the shim leaves no process group in ``parallel_state``."""
    from tests._dist import run_distributed

    [(forgotten, left)] = run_distributed(_groups_left_after_destroy, 1)
    assert set(forgotten) <= set(mc.LEFT_SET_BY_DESTROY) and forgotten, forgotten
    assert left == []


def test_clear_module_caches_lets_a_rotary_embedding_go(megatron_single):
    import gc
    import weakref

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    rotary(4)
    gone = weakref.ref(rotary)
    del rotary
    gc.collect()
    assert gone() is not None  # Megatron's forward cache holds it (and its context-parallel group)
    mc.clear_module_caches()
    gc.collect()
    assert gone() is None


def test_write_results_queue_comes_from_the_factory(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    for name in ("get_write_results_queue", "_get_write_results_queue", "_results_queue"):
        if hasattr(filesystem_async, name):
            monkeypatch.setattr(filesystem_async, name, getattr(filesystem_async, name))
    marker = object()
    mc.set_write_results_queue(lambda: marker)
    getter = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
    source = inspect.getsource(filesystem_async.FileSystemWriterAsync.prepare_write_data)
    assert getter() is marker
    name = "get_write_results_queue" if mc.version() >= (0, 17, 0) else "_get_write_results_queue"
    assert f"{name}()" in source  # the writer asks exactly this name


def test_a_failed_shard_write_keeps_its_error(tmp_path):
    """A bucket whose file cannot be opened: 0.16.1 puts the error itself in the results queue; 0.17+
    (the shim) raises it from the in-line writer (no queues), so its text reaches the caller."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    mc.keep_checkpoint_writer_errors()
    bucket = (str(tmp_path / "missing" / "__0_0.distcp"), "key", ([], []))
    if mc.version() < (0, 17, 0):
        results, count = queue.Queue(), queue.Queue()
        count.put(0)
        FileSystemWriterAsync.write_preloaded_data([], 0, bucket, results, count, True)
        assert isinstance(results.get_nowait()[1], FileNotFoundError)
    else:
        with pytest.raises(FileNotFoundError, match="No such file"):
            FileSystemWriterAsync.write_preloaded_data([], local_proc_idx=0, write_bucket=bucket, results_queue=None,
                                                      count_queue=None, use_fsync=True)


def test_async_save_kwargs_are_accepted_by_save():
    from megatron.core import dist_checkpointing

    kwargs = mc.async_save_kwargs()
    inspect.signature(dist_checkpointing.save).bind({}, "dir", async_sharded_save=True, **kwargs)
    default = inspect.signature(dist_checkpointing.save).parameters.get("async_strategy")
    assert (default is None) == (kwargs == {})  # 0.17+: chosen explicitly (the default "nvrx" needs NVRx)


def test_router_replay_hook_gets_asked_for_the_top_k(tiny_moe, megatron_single):
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_grpo.models import build_from_hf, forward_logits

    model, _ = build_from_hf(tiny_moe)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    calls = []

    class Hook:
        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            calls.append(scores.shape)
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)

    for router in routers:
        mc.set_router_replay(router, Hook())
    with torch.no_grad():
        forward_logits(model, torch.randint(3, 100, (2, 6)))
    assert len(calls) == len(routers) and all(shape[0] == 12 for shape in calls)


@pytest.mark.parametrize("compute, params", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_stage_output_dtype_is_megatrons_bias_dropout_add_dtype(compute, params):
    """Megatron's own bias-dropout-add of a layer output (autocast dtype) onto the residual (params
    dtype) gives the dtype a pipeline stage sends."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    autocast = not (compute == params or compute == torch.float32)
    out = torch.ones(2, 3, dtype=compute if autocast else params)
    residual = torch.ones(2, 3, dtype=params)
    got = get_bias_dropout_add(False, False)((out, None), residual, 0.0)
    assert got.dtype == mc.stage_output_dtype(compute, params)


def test_moe_aux_loss_multiplier_is_what_the_router_multiplies_by():
    """The router's z-loss (and, alike, aux-loss) scaling under ``calculate_per_token_loss``, read
    from its source (behaviour at TP = 2: tests/test_sequence_parallel.py's MoE gradients)."""
    from megatron.core.transformer.moe.router import TopKRouter

    source = inspect.getsource(TopKRouter.apply_z_loss)
    times_tp_cp = "num_local_tokens * self.tp_cp_group.size()" in source
    assert mc.moe_aux_loss_token_multiplier(5, 2) == (10 if times_tp_cp else 5)
    assert mc.moe_aux_loss_token_multiplier(5, 1) == 5


# ---- import costs and pins ------------------------------------------------------------------------------------


def _imported_after(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(sorted({m.split('.')[0] + ('.core' if "
                          "m.startswith('megatron.core') else '') for m in sys.modules if m.split('.')[0] in "
                          "('vllm', 'megatron')}))"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])


def test_compat_modules_and_light_commands_import_neither_megatron_core_nor_vllm(tmp_path):
    assert _imported_after("import megatron_grpo.compat.megatron, megatron_grpo.compat.vllm") == []
    assert _imported_after("from megatron_grpo import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n"
                           "    pass") == []
    assert _imported_after(f"from megatron_grpo import cli\ncli.main(['doctor', {str(tmp_path)!r}])") == []


PINNED = ("megatron-core", "vllm", "transformer-engine")
"""What we reach into: every requirement on these needs an upper bound."""


def test_pyproject_pins_what_we_reach_into_with_an_upper_bound():
    import tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    seen = set()
    for req in requirements:
        name = req.name.lower().replace("_", "-")
        if name in PINNED or name.startswith("vllm"):
            seen.add("vllm" if name.startswith("vllm") else name)
            uppers = [s for s in req.specifier if s.operator in ("<", "<=", "==", "===", "~=")]
            assert uppers, f"pyproject: {req} has no upper bound"
    assert seen == set(PINNED), f"pyproject does not name {set(PINNED) - seen}"
    gpu = {Requirement(r).name for r in project["optional-dependencies"]["gpu"]}
    assert {"vllm", "transformer-engine"} <= gpu


# ---- vLLM ---------------------------------------------------------------------------------------------------

vllm_only = pytest.mark.vllm


@vllm_only
def test_weight_transfer_engine_registers_once_in_both_factories():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from megatron_grpo.compat import vllm as vc

    try:
        for _ in range(2):  # the second call must not raise on the duplicate
            vc.register_weight_transfer_engine("compat-test", "megatron_grpo.rollout.transfer.gloo_engine",
                                               "GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine")
        assert "compat-test" in WeightTransferEngineFactory._registry
        assert "compat-test" in WeightTransferTrainerFactory._registry
    finally:
        WeightTransferEngineFactory._registry.pop("compat-test", None)
        WeightTransferTrainerFactory._registry.pop("compat-test", None)


@vllm_only
def test_pack_and_unpack_round_trip():
    from megatron_grpo.compat import vllm as vc

    bucket = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.tensor([1, 2], dtype=torch.int64)),
              ("c", torch.ones(3, dtype=torch.bfloat16)), ("d", torch.tensor([7, -8], dtype=torch.int32))]
    names, dtypes, shapes, sizes, buffer = vc.pack_tensors(bucket)
    assert names == ["a", "b", "c", "d"] and buffer.dtype == torch.uint8 and buffer.dim() == 1
    for (name, t), (got_name, got) in zip(bucket, vc.unpack_tensors(buffer, names, shapes, dtypes, sizes)):
        assert got_name == name and got.dtype == t.dtype and torch.equal(got, t)  # "d" sits at an odd offset (38)


@vllm_only
def test_layerwise_reload_takes_what_the_shims_pass():
    """Both ends of the reload take the arguments the shims pass (their behaviour on a live engine:
    tests/test_rollout.py's pushes)."""
    from vllm.model_executor.model_loader import reload

    from megatron_grpo.compat import vllm as vc

    inspect.signature(reload.initialize_layerwise_reload).bind(object())
    inspect.signature(reload.finalize_layerwise_reload).bind(object(), object())
    assert callable(vc.begin_layerwise_reload) and callable(vc.finish_layerwise_reload)


@vllm_only
def test_json_safe_update_payload_keeps_plain_fields():
    from megatron_grpo.compat import vllm as vc

    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    assert vc.json_safe_update_payload(info)["names"] == ["w"]
    assert vc.json_safe_update_payload([info])[0]["shapes"] == [[2]]
