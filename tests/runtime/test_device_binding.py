"""Which CUDA device a rank uses, and what `nnscaler.init` hands NCCL (issue 11), checked without a GPU
by standing in for torch.cuda and init_process_group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nnscaler.runtime import device as dev


@pytest.fixture
def cuda(monkeypatch):
    """A machine with `count` visible GPUs; records set_device and init_process_group calls."""
    state = {"count": 8, "current": 0, "set": [], "init": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])

    def set_device(d):
        state["set"].append(torch.device(d).index)
        state["current"] = torch.device(d).index

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: state["init"].append(kw))
    monkeypatch.setattr(dev, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    return state


def test_init_binds_the_local_rank_s_gpu_and_passes_it_as_device_id(cuda):
    dev.init(timeout=5)
    assert cuda["set"] == [3]
    (kwargs,) = cuda["init"]
    assert kwargs["backend"] == "nccl"
    assert kwargs["device_id"] == torch.device("cuda", 3)
    assert kwargs["timeout"].total_seconds() == 5


def test_one_visible_gpu_per_process_uses_device_0(cuda):
    cuda["count"] = 1  # CUDA_VISIBLE_DEVICES set per process by the launcher
    dev.init()
    assert cuda["set"] == [0]
    assert cuda["init"][0]["device_id"] == torch.device("cuda", 0)


def test_more_local_ranks_than_gpus_is_a_clear_error(cuda, monkeypatch):
    cuda["count"] = 4
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK is 5 but this process sees 4 CUDA devices"):
        dev.init()
    assert cuda["init"] == []


def test_bind_cuda_device_makes_the_rank_s_gpu_current_under_nccl(cuda, monkeypatch):
    monkeypatch.setattr(dev, "uses_nccl", lambda: True)
    assert dev.runtime_device() == torch.device("cuda", 3)
    dev.bind_cuda_device()  # a group made without nnscaler.init left device 0 current
    assert cuda["set"] == [3]
    dev.bind_cuda_device()
    assert cuda["set"] == [3]  # already current: not set again


def test_gloo_binds_nothing(cuda, monkeypatch):
    monkeypatch.setattr(dev, "uses_nccl", lambda: False)
    dev.bind_cuda_device()
    assert cuda["set"] == [] and dev.runtime_device() == torch.device("cpu")


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_gloo_on_a_gpu_machine_stays_on_the_cpu(cuda, monkeypatch, how):
    """init(backend='gloo') / $NNSCALER_BACKEND=gloo: a CPU run (e.g. the 4-process demo) on a machine
    with GPUs; no device is bound."""
    if how == "argument":
        dev.init(backend="gloo")
    else:
        monkeypatch.setenv(dev.BACKEND_ENV, "gloo")
        dev.init()
    (kwargs,) = cuda["init"]
    assert kwargs["backend"] == "gloo" and "device_id" not in kwargs
    assert cuda["set"] == []


def test_bad_backends_are_named(cuda, monkeypatch):
    with pytest.raises(ValueError, match=r"backend='mpi'.*'nccl' or 'gloo'"):
        dev.init(backend="mpi")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="backend 'nccl' needs CUDA.*backend='gloo'"):
        dev.init(backend="nccl")
    assert cuda["init"] == []
