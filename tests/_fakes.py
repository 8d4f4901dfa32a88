"""Stand-ins for the cluster paths CPU tests force: a tensor that says it lives on a GPU; a generator
engine without vLLM that starts, loads pushed weights and dies as the vLLM engine does."""

import os

import torch
from safetensors.torch import load_file

from megatron_grpo import faults
from megatron_grpo.rollout import Rollout, Rollouts
from megatron_grpo.rollout.types import GeneratorError


class OnFakeGPU(torch.Tensor):
    """A tensor that says it lives on cuda:0 (a bucket gathered on the trainer's GPU); copying it to
    host (``.cpu()`` / ``.to("cpu")``) gives a plain CPU tensor."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.cpu or (func is torch.Tensor.to and any(
            str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values())))
        if to_host:
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone()
        return super().__torch_function__(func, types, args, kwargs)


class FakeEngine:
    """A generator engine in milliseconds: generates ``seed`` as its only token, with the version of
    the weights it last loaded; loads pushed files like the vLLM worker (read, then unlink; dies on file
    ``fail_on_file``). Its start goes through the fault hook the vLLM engine's does
    (``faults.maybe_kill_starting_generator``: armed with ``start:K``, it dies while starting, a
    ``GeneratorError``); ``kill_process`` (``generate:N`` etc.) kills it while it runs."""

    def __init__(self, index, fail_on_file=None):
        self.index, self.fail_on_file, self.policy_version, self.dtype = index, fail_on_file, 0, torch.float32
        self.loaded, self.dead, self.slept = [], False, 0
        faults.maybe_kill_starting_generator(self)
        if self.dead:
            raise GeneratorError("fake generator process died during start (exit code -9)")

    def kill(self):
        """The process handle's ``kill`` (the fault hook's)."""
        self.dead = True

    kill_process = kill

    def _check_running(self):
        if self.dead:
            raise GeneratorError("fake generator process is not running (exit code -9)")

    def submit_generate(self, prompts, n, sampling):
        """Generates with the weights loaded now (as vLLM: a push waits for the requests in flight)."""
        self._check_running()
        rows = [(p, i, sampling.seed + p * n + i) for p in range(len(prompts)) for i in range(n)]
        return rows, list(prompts), self.policy_version

    def collect(self, handle):
        self._check_running()
        rows, prompts, version = handle
        return Rollouts([Rollout(p, prompts[p], [seed], [0.0], "length", version) for p, i, seed in rows])

    def begin_weight_push(self):
        self._check_running()
        self.files = 0

    def push_file(self, path):
        self.files += 1
        if self.files == self.fail_on_file:
            self.dead = True
            raise GeneratorError(f"engine {self.index} died")
        self.loaded += list(load_file(path))
        os.unlink(path)

    def end_weight_push(self, version):
        self.policy_version = version

    def alive(self):
        return not self.dead

    def sleep(self, level):
        self.slept += 1

    def wake_up(self):
        self.slept -= 1

    def close(self):
        pass
