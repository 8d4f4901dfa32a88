"""Makes Megatron-Core (0.16.1, 0.19) run on a CPU-only torch build with gloo.

Every CUDA-only spot we hit is bypassed here and nowhere else; ``install()`` is a
no-op when CUDA is available. The spots (see ../shared/ENVIRONMENT.md):

- ``torch.cuda.current_device()`` used as a ``device=`` argument (~40 call sites)
  -> returns ``"cpu"``; ``torch.cuda.synchronize`` / ``Stream`` / ``Event`` -> no-ops;
- the default causal and sliding-window masks built with ``device="cuda"`` -> CPU copies of the functions;
- the CUDA RNG-states tracker -> ``CPURNGStatesTracker`` (same interface, CPU
  generator states, one independent stream per name so TP ranks get distinct dropout);
- ``custom_fwd/custom_bwd(device_type="cuda")`` around the TP linear autograd
  functions -> rewrapped for ``device_type="cpu"`` so bf16/fp16 autocast backward works;
- MoE router's module-level ``te_general_gemm`` missing without TE (0.16.1) -> set to None;
- ``device="cuda"`` tensor factories in the pipeline schedules, Megatron's optimizers, grad
  clipping, grad scalers, ``core/utils`` (the local multi-tensor L2 norm) and the fully parallel
  load's exchange -> those modules see a ``torch`` whose factories map ``"cuda"`` to ``"cpu"``;
  ``ShardedTensor.init_data("cuda")`` (that exchange's receive buffers) -> on the CPU;
- ``param.type() == 'torch.cuda.FloatTensor'``-style checks in the optimizers and grad clipping
  -> ``Tensor.type()`` answers with the CUDA type name when (and only when) the caller is one of
  Megatron's optimizer modules;
- ``DynamicGradScaler.load_state_dict`` moving the scale with ``.cuda()`` -> kept on CPU;
- ``Tensor.cuda()`` called from Megatron-Core (``language_module``'s ``weight.data.cuda()`` for
  tied embeddings under PP, the distributed optimizer's state gathers) -> the tensor itself.

Not a CUDA spot but a CPU one: without TE's or Apex's FusedAdam, Megatron-Core builds torch's
``AdamW`` with torch's defaults, which on CPU tensors is the per-tensor Python loop (torch picks
its multi-tensor and fused paths by default on CUDA only). ``fuse_torch_adam`` switches such an
optimizer to torch's fused CPU kernel (the same Adam update in one pass per tensor): measured with
``tools/bench/bench_optimizer.py`` (its ``unfused`` row) on a 26M Qwen3, one thread per rank. Likewise, without
Apex's ``fused_weight_gradient_mlp_cuda`` Megatron-Core computes each weight gradient into a new tensor that
DDP's hook then adds to ``main_grad``; ``fuse_wgrad_accumulation`` gives Megatron's own
``gradient_accumulation_fusion`` path a CPU kernel (one ``addmm_`` into ``main_grad``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys

import torch

from megatron_grpo.compat import megatron as compat

logger = logging.getLogger(__name__)
_INSTALLED = False


def cuda_available() -> bool:
    """True when a CUDA device can be used (then none of the shims is installed)."""
    return torch.cuda.is_available()


def install() -> None:
    """Installs every shim once; no-op on a CUDA machine."""
    global _INSTALLED
    if _INSTALLED or cuda_available():
        return
    _patch_torch_cuda()
    _patch_megatron()
    _INSTALLED = True
    logger.debug("megatron_grpo.parallel.cpu: CPU shims installed")


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()


class _NullEvent(_NullStream):
    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None


def _patch_megatron() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import layers, random
    from megatron.core.transformer import utils as transformer_utils

    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_sliding_window_causal_mask = _cpu_sliding_window_mask
    transformer_utils.get_sliding_window_causal_mask = _cpu_sliding_window_mask
    _rewrap_autocast(layers)
    from megatron.core.optimizer import grad_scaler

    modules = compat.cuda_factory_modules()
    for module in modules:
        module.torch = _CPUTorch()
    _patch_init_data(next(m for m in modules if m.__name__.endswith("exchange_utils")).ShardedTensor)
    _patch_type_names()
    _patch_tensor_cuda()
    grad_scaler.DynamicGradScaler.load_state_dict = _scaler_load_state_dict
    random._CUDA_RNG_STATE_TRACKER = _TRACKER
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    compat.define_missing_te_general_gemm()


def _patch_init_data(sharded_tensor) -> None:
    """``ShardedTensor.init_data("cuda")`` (the fully parallel load's exchange buffers, ``sharded_tensor``
    being Megatron's ``ShardedTensor`` class) allocates on the CPU."""
    original = sharded_tensor.init_data
    if getattr(original, "_megatron_grpo", False):
        return

    def init_data(self, device, init_fn=torch.empty):
        return original(self, "cpu" if str(device).startswith("cuda") else device, init_fn)

    init_data._megatron_grpo = True
    sharded_tensor.init_data = init_data


class _CPUTorch:
    """``torch`` for modules that hard-code ``device="cuda"`` in tensor factories."""

    _FACTORIES = ("zeros", "ones", "empty", "empty_like", "full", "tensor", "arange")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            return functools.partial(_on_cpu, attr)
        if name == "autocast":
            return lambda device_type, *a, **k: torch.autocast("cpu" if device_type == "cuda" else device_type, *a, **k)
        return attr


def _on_cpu(factory, *args, **kwargs):
    if str(kwargs.get("device", "cpu")).startswith("cuda"):
        kwargs["device"] = "cpu"
    return factory(*args, **kwargs)


_CUDA_TYPE_CALLERS = ("megatron.core.optimizer.",)


def _patch_type_names() -> None:
    """``Tensor.type()`` (no argument) answers ``torch.cuda.FloatTensor`` for a CPU float tensor
    when called from Megatron's optimizer package, whose type-name checks assume CUDA."""
    original = torch.Tensor.type
    if getattr(original, "_megatron_grpo", False):
        return

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return "torch.cuda." + name[len("torch."):] if caller.startswith(_CUDA_TYPE_CALLERS) else name

    type_._megatron_grpo = True
    torch.Tensor.type = type_


def _patch_tensor_cuda() -> None:
    """``Tensor.cuda()`` from a ``megatron.core`` module returns the (CPU) tensor itself."""
    original = torch.Tensor.cuda
    if getattr(original, "_megatron_grpo", False):
        return

    def cuda(self, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("megatron.core."):
            return self
        return original(self, *args, **kwargs)

    cuda._megatron_grpo = True
    torch.Tensor.cuda = cuda


def _scaler_load_state_dict(self, state_dict) -> None:
    """``DynamicGradScaler.load_state_dict`` without its ``.cuda()``."""
    self._scale = state_dict["scale"].to("cpu")
    self._growth_tracker = state_dict["growth_tracker"]
    self._hysteresis_tracker = state_dict["hysteresis_tracker"]


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """``[sq, sq]`` bool, True above the diagonal (masked), as Megatron's but on CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """``[sq, skv]`` bool, True where a query may not see a key under ``window_size = (left, right)``
    (Mistral's sliding window), as Megatron's ``get_sliding_window_causal_mask`` but on CPU."""
    visible = torch.ones(sq, skv, dtype=torch.bool)
    visible = torch.tril(torch.triu(visible, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])
    return ~visible


def _rewrap_autocast(layers_module) -> None:
    """Re-decorates the TP linear autograd functions with ``device_type="cpu"``."""
    for cls_name in ("LinearWithFrozenWeight", "LinearWithGradAccumulationAndAsyncCommunication"):
        cls = getattr(layers_module, cls_name)
        fwd = cls.__dict__["forward"].__func__
        bwd = cls.__dict__["backward"].__func__
        cls.forward = staticmethod(torch.amp.custom_fwd(getattr(fwd, "__wrapped__", fwd), device_type="cpu"))
        cls.backward = staticmethod(torch.amp.custom_bwd(getattr(bwd, "__wrapped__", bwd), device_type="cpu"))


class CPURNGStatesTracker:
    """CPU stand-in for Megatron's ``CudaRNGStatesTracker`` (``add``/``fork``/states)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


_TRACKER = CPURNGStatesTracker()


def fuse_torch_adam(optimizers) -> int:
    """Switches every torch ``Adam`` / ``AdamW`` among ``optimizers`` (Megatron's wrappers, each
    holding ``.optimizer``) whose parameters all live on CPU to torch's fused kernel; returns how many.
    TE's / Apex's FusedAdam (GPU) and optimizers with any non-CPU parameter are left as they are. The
    state (moments, the fp32 ``step``) is the unfused layout, so checkpoints load either way."""
    switched = 0
    for wrapper in optimizers:
        inner = getattr(wrapper, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or any(p.device.type != "cpu" for p in params):
            continue
        for group in [inner.defaults, *inner.param_groups]:
            group["fused"], group["foreach"] = True, False
        switched += 1
    return switched


class CPUWgradAccum:
    """The two kernels of Apex's ``fused_weight_gradient_mlp_cuda`` that Megatron-Core's tensor-parallel linear
    backward calls under ``gradient_accumulation_fusion``: ``main_grad += grad_output^T @ input`` (2-D; Megatron
    flattens both first). Same dtypes: one ``addmm_`` into the buffer (no weight-gradient tensor, no separate
    add pass). Otherwise (bf16 / fp16 compute into fp32 buffers) the GEMM runs as the unfused backward runs it
    (under the backward's autocast) and is then added: the unfused path's numerics."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        a, b = grad_output, total_input
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            a, b = a.to(dtype), b.to(dtype)
        elif a.dtype != b.dtype:
            dtype = torch.promote_types(a.dtype, b.dtype)
            a, b = a.to(dtype), b.to(dtype)
        if a.dtype == main_grad.dtype:
            main_grad.addmm_(a.t(), b)
        else:
            main_grad.add_(a.t().mm(b))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def fuse_wgrad_accumulation(model) -> int:
    """CPU: turns on Megatron-Core's own ``gradient_accumulation_fusion`` for every tensor-parallel linear layer
    of ``model`` (DDP-wrapped: each weight has its ``main_grad`` buffer) that owns its weight, with
    :class:`CPUWgradAccum` as the kernel; returns how many layers. The weight gradient is accumulated straight
    into DDP's buffer (as on GPU with Apex / TE) instead of a weight-gradient tensor that DDP's hook then adds.
    A layer fed a weight owned elsewhere (the output layer with tied embeddings: the embedding's own gradient
    arrives through the same parameter) keeps the unfused path. No-op with CUDA, where the config decides."""
    if cuda_available():
        return 0
    from megatron.core.tensor_parallel import layers

    if not hasattr(layers, "_grad_accum_fusion_available"):
        logger.warning("megatron.core.tensor_parallel.layers has no _grad_accum_fusion_available: "
                       "weight-gradient accumulation stays unfused")
        return 0
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = CPUWgradAccum
        layers._grad_accum_fusion_available = True
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)) \
                and isinstance(weight, torch.nn.Parameter) and hasattr(weight, "main_grad"):
            module.gradient_accumulation_fusion = True
            count += 1
    return count


def model_parallel_seed(seed: int) -> None:
    """Seeds torch and Megatron's named RNG streams as ``model_parallel_cuda_manual_seed`` does."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random

    torch.manual_seed(seed)
    if cuda_available():
        random.model_parallel_cuda_manual_seed(seed)
        return
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    _TRACKER.reset()
    _TRACKER.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    _TRACKER.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    _TRACKER.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    random._CUDA_RNG_STATE_TRACKER = _TRACKER
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def default_backend() -> str:
    """``nccl`` with CUDA, else ``gloo``; ``MEGATRON_GRPO_DIST_BACKEND`` overrides."""
    return os.environ.get("MEGATRON_GRPO_DIST_BACKEND") or ("nccl" if cuda_available() else "gloo")
