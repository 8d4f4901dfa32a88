"""Stand-ins for the cluster paths CPU tests force: a tensor that says it lives on a GPU."""

import torch


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
