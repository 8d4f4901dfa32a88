"""The generator process: an offline ``vllm.LLM`` (in-process mode) serving commands.

vLLM runs in its own process so that its distributed set-up never meets the trainer's
process groups (an in-process ``vllm.LLM`` on rank 0 of a 2-rank gloo world hangs), and
so that a crash of the generator is detected and recoverable. Commands come through a
``torch.multiprocessing`` queue; weight buckets arrive as safetensors file paths (under
/dev/shm, written once for every engine of the pool: ``fanout.py``) that the worker extension
(``server_ext.WeightLoaderExtension``) reads into ``reload_weights``, one bucket at a time; the
generator unlinks each once read. Files, not pickled tensors, because with
``tensor_parallel_size`` > 1 the vLLM workers are processes of their own.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import torch

from megatron_grpo.observe import quiet
from megatron_grpo.observe.quiet import is_verbose
from megatron_grpo.rollout.transfer import gloo_transfer

_TRAINER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _die_with_parent() -> None:
    """The generator leaves the trainer's process group (a SIGTERM to the group, what Slurm sends
    on preemption, must reach the trainer, which saves and then closes the generator, not kill the
    generator under it), but must not outlive the trainer (a SIGKILLed trainer would leave it, and
    the pipes it holds, behind): Linux's parent-death signal, plus a watchdog thread."""
    try:
        os.setsid()
    except OSError:  # already a group leader
        pass
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux
        pass

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def serve(options: dict, requests, responses) -> None:
    """Process entry point: build the engine, then answer (command, payload) requests until ``close``."""
    _die_with_parent()
    for key in _TRAINER_ENV:
        os.environ.pop(key, None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(options.get("kv_cache_gib", 1)))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if options.get("cpu_bind"):  # this engine's share of the cores: "0|1" = TP worker 0 on core 0, 1 on 1
        _bind_cores(options["cpu_bind"], int(options.get("tensor_parallel_size", 1)))
    if options.get("devices"):  # GPU placement (the pool's); ignored without CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in options["devices"])

    quiet.install(verbose=quiet.is_verbose())
    try:
        llm = _build(options)
    except BaseException:  # noqa: BLE001 - report start-up failures to the trainer
        responses.put((0, "error", traceback.format_exc()))
        return
    responses.put((0, "ok", "ready"))
    handlers = {"generate": _generate, "score": _score, "load": _load, "weight_sync": _weight_sync,
                "ping": lambda llm, p, q: "pong",
                "sleep": _sleep, "wake_up": lambda llm, p, q: llm.wake_up()}
    while True:
        request_id, command, payload = requests.get()
        if command == "close":
            responses.put((request_id, "ok", None))
            return
        try:
            responses.put((request_id, "ok", handlers[command](llm, payload, requests)))
        except BaseException:  # noqa: BLE001
            responses.put((request_id, "error", traceback.format_exc()))


def _sleep(llm, level, requests) -> None:
    """vLLM's sleep (weights offloaded, KV cache freed), then this process's own cached blocks (sampling and
    scoring temporaries outside vLLM's pool) back to the driver, so the trainer can use them."""
    llm.sleep(level=level)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _bind_cores(cpu_bind: str, tp: int) -> None:
    """TP > 1: vLLM's multiprocess executor binds each TP worker to its list (``VLLM_CPU_OMP_THREADS_BIND``).
    TP = 1 runs the model in this process (``uni`` executor), where vLLM binds nothing: pin this
    process and size torch's thread pool to the list, so engines sharing a host do not fight over
    the same cores (2 unpinned engines on 2 busy cores ran at 0.2-0.3x their pinned tokens/s)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    if tp > 1:
        return

    cpus = sorted({int(c) for part in cpu_bind.split(",") for c in _id_range(part)})
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError):  # not Linux, or a core this process may not use
        pass
    torch.set_num_threads(len(cpus))


def _id_range(part: str):
    lo, _, hi = part.strip().partition("-")
    return range(int(lo), int(hi or lo) + 1)


def _build(options: dict):
    from vllm import LLM  # after serve() set the process's placement and threads: the generator's boundary

    extra = {"enable_prefix_caching": True, "use_tqdm_on_load": is_verbose()}
    tp = int(options.get("tensor_parallel_size", 1))
    if options.get("sleep_mode"):
        extra["enable_sleep_mode"] = True
    if options.get("weight_transfer", "file") != "file":  # vLLM's weight-transfer API (``transport.py``)
        gloo_transfer.register()  # what the entry point does; also works from a source checkout that is not pip-installed
        extra["weight_transfer_config"] = {"backend": options["weight_transfer"]}
    extra.update(options.get("fp8") or {})  # vLLM's block FP8 (``vllm_engine.fp8_engine_options``)
    if options.get("return_routed_experts"):
        # vLLM returns routed experts through its AuxOutput connector, which needs Model Runner V2
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        extra["enable_return_routed_experts"] = True
        extra["enable_prefix_caching"] = False  # every position's routing comes from this request's forward
    return LLM(
        model=options["model"], dtype=options["dtype"], enforce_eager=True, tensor_parallel_size=tp,
        distributed_executor_backend="uni" if tp == 1 else "mp",
        worker_extension_cls="megatron_grpo.rollout.engines.server_ext.WeightLoaderExtension",
        skip_tokenizer_init=True, logprobs_mode="processed_logprobs", seed=options.get("seed", 0),
        max_model_len=options["max_model_len"], gpu_memory_utilization=options.get("gpu_memory_utilization", 0.5),
        **extra,
    )


def _generate(llm, payload, requests):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, params, ignore_eos = [], [], bool(payload.get("ignore_eos", False))
    for index, ids in enumerate(payload["prompts"]):
        for i in range(payload["n"]):
            seed = None if payload["seed"] is None else payload["seed"] + index * payload["n"] + i
            prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
            params.append(SamplingParams(
                n=1, temperature=payload["temperature"], top_p=payload["top_p"], top_k=payload["top_k"],
                max_tokens=payload["max_tokens"], logprobs=0, seed=seed, ignore_eos=ignore_eos,
                stop_token_ids=None if ignore_eos else list(payload["stop_token_ids"]) or None,
            ))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = [entry[tok].logprob for tok, entry in zip(completion.token_ids, completion.logprobs)]
        routes = getattr(completion, "routed_experts", None)
        results.append((list(completion.token_ids), logprobs, completion.finish_reason,
                         None if routes is None else routes.astype("int16")))
    return results


def _score(llm, payload, requests):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in payload["sequences"]], params,
                           use_tqdm=False)
    scores = []
    for out, seq, start in zip(outputs, payload["sequences"], payload["prompt_lens"]):
        entries = out.prompt_logprobs
        scores.append([entries[t][seq[t]].logprob for t in range(start, len(seq))])
    return scores


def _load(llm, payload, requests):
    """Loads the bucket files whose paths follow on the queue (until None), unlinking each once
    read; returns the number of tensors loaded. After a failure the rest of the push is drained
    (and unlinked) so the command stream stays in sync, then the failure is raised."""
    num_loaded, failure = 0, None
    llm.collective_rpc("megatron_grpo_begin_push")  # one layerwise reload for the whole push
    while True:
        path = requests.get()
        if path is None:
            break
        try:
            if failure is None:
                num_loaded += llm.collective_rpc("megatron_grpo_load", args=(path, "0"))[0]
        except BaseException:  # noqa: BLE001
            failure = traceback.format_exc()
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    llm.collective_rpc("megatron_grpo_end_push", args=("1" if failure is not None else "0",))
    if failure is not None:
        raise RuntimeError(failure)
    if payload.get("is_moe"):
        llm.collective_rpc("megatron_grpo_repack_moe")
    llm.reset_prefix_cache()  # KV computed with the old weights must not be reused
    return num_loaded


def _weight_sync(llm, payload, requests):
    """vLLM's offline RL API (``LLM.init_weight_transfer_engine`` ...), one (method, argument) per call."""
    method, arg = payload
    if method == "init":
        return llm.init_weight_transfer_engine(dict(init_info=arg))
    if method == "start":
        return llm.start_weight_update()
    if method == "update":
        return llm.update_weights(dict(update_info=arg))
    if method == "finish":
        llm.finish_weight_update(arg)
        return llm.reset_prefix_cache()  # KV computed with the old weights must not be reused
    if method == "set_version":
        return llm.update_weight_version(arg)
    if method == "version":
        return llm.get_weight_version()
    if method == "checksums":  # what the server's /weight_checker returns: every worker's digests, merged
        merged = {}
        for digests in llm.llm_engine.collective_rpc("compute_weight_checksums"):
            merged.update(digests)
        return merged
    raise ValueError(f"weight_sync: unknown method {method!r}")


def _repack_moe(worker) -> None:
    repack_moe(worker.model_runner.model)


def repack_moe(model) -> None:
    """CPU fused-MoE layers keep the raw expert layout after ``reload_weights``.

    vLLM 0.32 prepacks experts into the CPU grouped-GEMM layout only on the first
    load (``UnquantizedFusedMoEMethod._setup_kernel`` skips the kernel's own
    ``process_weights_after_loading`` on weight updates); run that step again
    (a no-op for dense models).
    """
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if hasattr(module, "w13_weight") and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
