"""No silent hangs: what used to wait forever (or for gloo's 30 minutes) raises within a short timeout.

- `nnscaler.init(timeout=...)` reaches the process group: a collective that the peer never joins
  raises on the rank that called it within that timeout ($NNSCALER_TIMEOUT is the default).
- rank 0's compile in `parallelize` is waited for through the store, not in a collective: a compile
  slower than the collective timeout still succeeds on every rank, and a compile that fails on rank 0
  makes the other ranks raise with rank 0's error text and traceback tail; a rank 0 that dies is
  noticed at once, a rank 0 that never answers after NNSCALER_COMPILE_TIMEOUT.
- ZeRO-3 `state_dict()` called on rank 0 only raises there, naming rank 1, while rank 1 does
  something else and finishes cleanly.

Every multi-process test runs under `run_dist`'s overall timeout (and pytest-timeout), so a
regression fails instead of hanging CI.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist

import nnscaler
from nnscaler.config import ComputeConfig
from nnscaler.runtime import ParallelModule, build_optimizer
from nnscaler.runtime.dist.groups import create_groups, get_group
from nnscaler.runtime.dist.store_sync import PeerError, default_store, publish_outcome, wait_outcome
from nnscaler.runtime.dist.timeouts import DEFAULT_TIMEOUT, collective_timeout, compile_timeout, group_timeout

try:
    from .dist_util import run_dist
except ImportError:
    from dist_util import run_dist

RUN_LIMIT = 90.0
"""Seconds one 2-rank run may take in all (a hang fails the test after this)."""


def _handshake(rank: int, name: str) -> None:
    """Rank 1 waits until rank 0 says it is done, then acknowledges (rank 0 hosts the store: it must
    not leave while rank 1 still reads from it)."""
    store = default_store()
    if rank == 0:
        store.set(f"test/{name}/done", b"1")
        store.wait([f"test/{name}/ack"], datetime.timedelta(seconds=60))
    else:
        store.wait([f"test/{name}/done"], datetime.timedelta(seconds=60))
        store.set(f"test/{name}/ack", b"1")


# ---- nnscaler.init(timeout) ----------------------------------------------------------------------


def test_timeout_values_and_defaults(monkeypatch):
    monkeypatch.delenv("NNSCALER_TIMEOUT", raising=False)
    monkeypatch.delenv("NNSCALER_COMPILE_TIMEOUT", raising=False)
    assert collective_timeout() == DEFAULT_TIMEOUT == datetime.timedelta(minutes=10)
    assert compile_timeout() == datetime.timedelta(hours=1)
    assert collective_timeout(2.5) == datetime.timedelta(seconds=2.5)
    assert collective_timeout(datetime.timedelta(minutes=1)) == datetime.timedelta(seconds=60)
    monkeypatch.setenv("NNSCALER_TIMEOUT", "7")
    assert collective_timeout() == datetime.timedelta(seconds=7)
    assert collective_timeout(3) == datetime.timedelta(seconds=3)  # the argument wins
    for bad in (0, -1, float("nan"), "10", True):
        with pytest.raises(ValueError, match="timeout"):
            collective_timeout(bad)
    monkeypatch.setenv("NNSCALER_TIMEOUT", "ten minutes")
    with pytest.raises(ValueError, match="NNSCALER_TIMEOUT"):
        collective_timeout()


def _stalled_peer(rank: int, world_size: int) -> list[tuple[str, float, str]]:
    nnscaler.init(timeout=2)
    create_groups([[0, 1]])  # a group made by the runtime (tp, dp, ZeRO) gets the world's timeout
    sub = get_group([0, 1])
    assert group_timeout() == group_timeout(sub) == datetime.timedelta(seconds=2)
    results = []
    if rank == 0:  # rank 1 never joins these all-reduces
        for name, group in (("world", None), ("runtime group", sub)):
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=group)
                results.append((name, time.monotonic() - start, "no error"))
            except RuntimeError as err:
                results.append((name, time.monotonic() - start, str(err)))
    _handshake(rank, "stalled")
    nnscaler.uninit()  # the timed-out all-reduces leave the groups unusable
    return results


def test_init_timeout_bounds_a_collective_the_peer_never_joins():
    results = run_dist(_stalled_peer, 2, timeout=RUN_LIMIT, init=False)[0]
    assert [name for name, _, _ in results] == ["world", "runtime group"]
    for name, took, error in results:
        print(f"rank 0's all_reduce on the {name} raised after {took:.2f} s: {error.splitlines()[0][:200]}")
        assert error != "no error", name
        assert "timed out" in error.lower() or "timeout" in error.lower(), error
        assert 1.5 < took < 20, (name, took)


# ---- rank 0's compile, through the store -----------------------------------------------------------


def _compile_slow_then_broken(rank: int, world_size: int, savedir: str) -> dict[str, object]:
    nnscaler.init(timeout=2)  # shorter than rank 0's compile below: nobody waits in a collective
    driver = importlib.import_module("nnscaler.parallel.parallelize")  # the module, not the function
    real_compile = driver.compile_module
    calls = []

    def slow_compile(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("no split for node linear_1 (forced on rank 0 by the test)")
        time.sleep(3)
        return real_compile(*args, **kwargs)

    if rank == 0:
        driver.compile_module = slow_compile
    linear, x = torch.nn.Linear(4, 3), {"input": torch.randn(2, 4)}
    cfg = ComputeConfig(1, 2)
    pm = nnscaler.parallelize(linear, x, "dp", cfg, gen_savedir=savedir, instance_name="slow")
    out = {"first": tuple(pm(torch.randn(2, 4)).shape)}
    start = time.monotonic()
    try:
        nnscaler.parallelize(linear, x, "dp", cfg, gen_savedir=savedir, instance_name="broken")
        out["second"] = "no error"
    except Exception as err:  # noqa: BLE001 (the test reports whatever came)
        out["second"] = f"{type(err).__name__}|{isinstance(err, RuntimeError)}|{err}"
    out["waited"] = time.monotonic() - start
    dist.barrier()
    return out


def test_rank0_compile_error_reaches_the_other_ranks_through_the_store(tmp_path):
    r0, r1 = run_dist(_compile_slow_then_broken, 2, str(tmp_path), timeout=RUN_LIMIT, init=False)
    print(f"rank 1 raised after {r1['waited']:.2f} s: {r1['second']}")
    assert r0["first"] == r1["first"] == (2, 3)  # the 3 s compile outlived the 2 s collective timeout
    assert r0["second"].startswith("ValueError|"), r0["second"]
    kind, is_runtime, message = r1["second"].split("|", 2)
    assert kind == "PeerError" and is_runtime == "True", r1["second"]
    assert "rank 0 could not generate the parallel module" in message
    assert "ValueError: no split for node linear_1 (forced on rank 0 by the test)" in message
    assert "slow_compile" in message  # the tail of rank 0's traceback
    assert r1["waited"] < 20


def test_waiting_for_an_outcome_that_never_comes_times_out():
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(
        PeerError, match=r"rank 0 did not generate the parallel module within .*NNSCALER_COMPILE"
    ):
        wait_outcome("k", src=0, what="generate the parallel module", timeout=0.3, store=store, me=1)
    assert time.monotonic() - start < 5
    publish_outcome("k2", None, store=store)
    wait_outcome("k2", src=0, what="x", timeout=1, store=store, me=1)  # success returns


def _host_store_then_die(ports) -> None:
    # port 0: the store listens on a port the OS picks, so no other process can take it in between
    store = dist.TCPStore(
        "127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )
    ports.put(store.port)
    store.set("up", b"1")
    time.sleep(1.0)
    os._exit(1)  # like a rank 0 killed in the middle of compiling


def test_a_dead_rank0_is_noticed_at_once_not_after_the_compile_timeout():
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_host_store_then_die, args=(ports,))
    proc.start()
    try:
        port = ports.get(timeout=60)
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
        client.wait(["up"])
        start = time.monotonic()
        with pytest.raises(PeerError, match="lost contact .* rank 0 .*probably died"):
            wait_outcome("nnscaler/parallelize/1", src=0, what="compile", timeout=600, store=client, me=1)
        assert time.monotonic() - start < 20
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


# ---- ZeRO-3 state_dict() on a subset of ranks -------------------------------------------------------


class _Zero3Gen(ParallelModule):
    """A hand-written 'generated' module of two linear layers, data parallel over 2 ranks."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank=rank, world_size=2, plan_ngpus=1, groups={}, all_groups=[[0, 1]])
        self.add_shard("l0_w", "layers.0.weight", (4, 4), torch.float32)
        self.add_shard("l1_w", "layers.1.weight", (4, 4), torch.float32)
        self.load_shards(init_params=False)
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_(torch.arange(16.0).view(4, 4) + i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.l0_w @ self.l1_w).sum()


def _state_dict_on_rank0_only(rank: int, world_size: int) -> dict[str, object]:
    os.environ["NNSCALER_TIMEOUT"] = "30"
    os.environ["NNSCALER_ARRIVAL_TIMEOUT"] = "1.5"
    nnscaler.init()
    assert group_timeout() == datetime.timedelta(seconds=30)  # $NNSCALER_TIMEOUT is the default
    pm = _Zero3Gen(rank)
    pm.compute_config = ComputeConfig(1, 2, use_zero=True, zero_stage=3)
    build_optimizer(pm, lambda params: torch.optim.SGD(params, lr=0.1))
    assert pm._zero3 is not None
    out: dict[str, object] = {}
    for _ in range(3):  # called on every rank: the check passes (and old arrival keys are dropped)
        sd = pm.state_dict()
    out["full"] = sd["layers.1.weight"].clone()
    start = time.monotonic()
    if rank == 0:
        try:
            pm.state_dict()
            out["error"] = "no error"
        except Exception as err:  # noqa: BLE001
            out["error"] = f"{type(err).__name__}|{err}"
    else:
        out["error"] = "rank 1 did something else"
    out["took"] = time.monotonic() - start
    _handshake(rank, "zero3")
    return out


def test_zero3_state_dict_on_one_rank_raises_naming_the_other():
    r0, r1 = run_dist(_state_dict_on_rank0_only, 2, timeout=RUN_LIMIT, init=False)
    print(f"rank 0 raised after {r0['took']:.2f} s: {r0['error']}")
    torch.testing.assert_close(r0["full"], torch.arange(16.0).view(4, 4) + 1)
    torch.testing.assert_close(r1["full"], r0["full"])
    kind, message = r0["error"].split("|", 1)
    assert kind == "PeerError", r0["error"]
    assert "rank(s) 1 did not reach state_dict() of a ZeRO-3 ParallelModule within 1.5 s" in message
    assert "call #4 on this rank; rank(s) 0 came" in message
    assert "Every rank of the ZeRO group must call it" in message
    assert 1.0 < r0["took"] < 15
    assert r1["error"] == "rank 1 did something else"
