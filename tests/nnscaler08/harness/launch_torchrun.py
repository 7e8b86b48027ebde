# Replaces nnScaler 0.8's tests/launch_torchrun.py when its tests run against this package (run_upstream.sh):
# the same functions, ranks as CPU processes joined with gloo; `.cuda()` and device='cuda' become the
# CPU in each worker.
import os
import socket
import uuid
from collections.abc import Callable

import torch
from torch.distributed.run import LaunchConfig, elastic_launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _cpu_patches():
    orig_init = torch.distributed.init_process_group

    def init_pg(*args, **kwargs):
        if kwargs.get("backend") in ("nccl", None) and not args:
            kwargs["backend"] = "gloo"
        elif args and args[0] == "nccl":
            args = ("gloo",) + tuple(args[1:])
        return orig_init(*args, **kwargs)

    torch.distributed.init_process_group = init_pg
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    for name in ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "tensor", "arange"):
        setattr(torch, name, _cpu_device(getattr(torch, name)))
    orig_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return orig_to(self, *args, **kwargs)

    torch.Tensor.to = to


def _is_cuda(dev) -> bool:
    return (isinstance(dev, str) and dev.startswith("cuda")) or (
        isinstance(dev, torch.device) and dev.type == "cuda"
    )


def _cpu_device(fn):
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    return wrapper


def _run_worker(fn, *args, **kwargs):
    os.environ.setdefault("NNSCALER_BACKEND", "gloo")
    _cpu_patches()
    return fn(*args, **kwargs)


def launch_torchrun(nproc_per_node, worker_fn, *args, **kwargs):
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        rdzv_backend="c10d",
        rdzv_endpoint=f"localhost:{_free_port()}",
        run_id=str(uuid.uuid4()),
        monitor_interval=0.1,
        max_restarts=0,
        start_method="spawn",
    )
    return elastic_launch(launch_config, _run_worker)(worker_fn, *args, **kwargs)


def torchrun(nproc_per_node: int, test_fn: Callable, *args, **kwargs):
    launch_torchrun(nproc_per_node, test_fn, *args, **kwargs)


def clone_to_cpu(tensor: torch.Tensor):
    cloned_tensor = tensor.cpu().clone().detach().requires_grad_(tensor.requires_grad)
    if tensor.is_leaf and tensor.grad is not None:
        cloned_tensor.grad = tensor.grad.cpu().clone()
    return cloned_tensor


def clone_to_cpu_recursively(data):
    if isinstance(data, torch.Tensor):
        return clone_to_cpu(data)
    elif isinstance(data, dict):
        return {k: clone_to_cpu_recursively(v) for k, v in data.items()}
    elif isinstance(data, list):
        return [clone_to_cpu_recursively(v) for v in data]
    elif isinstance(data, tuple):
        return tuple(clone_to_cpu_recursively(v) for v in data)
    else:
        return data
