"""The ranks of one plan must get the same input values, not only the same shapes: the per-call check
compares a checksum of each input (nnscaler.runtime.dist.checksums) over the plan's ranks and raises on all
of them, naming the input; data-parallel replicas get different batches and are never compared."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from nnscaler.runtime.dist.checksums import combine_checksums, tensor_checksum

try:
    from .dist_util import run_dist
    from .test_module import BATCH, D, Gen, Ref
except ImportError:
    from dist_util import run_dist
    from test_module import BATCH, D, Gen, Ref


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool, torch.complex64],
)
def test_checksum_sees_one_changed_element_and_moved_values(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g) * 100
    x = (x > 0) if dtype == torch.bool else x.to(dtype)
    assert torch.equal(tensor_checksum(x), tensor_checksum(x.clone()))
    assert torch.equal(
        tensor_checksum(x[:, 1:]), tensor_checksum(x[:, 1:].contiguous())
    )  # strides do not count
    flat = x.reshape(-1)
    assert torch.equal(tensor_checksum(flat[1:]), tensor_checksum(flat[1:].clone()))  # unaligned start
    for where in ((3, 2), (5, 4)):  # inside, and in the last (partial, for small dtypes) 8-byte word
        changed = x.clone()
        changed[where] = (changed[where] == 0).to(dtype) if dtype == torch.bool else changed[where] + 1
        assert tensor_checksum(changed)[0] != tensor_checksum(x)[0]  # the plain sum sees any single change
    swapped = x[[1, 0, 2, 3, 4, 5]]
    assert not torch.equal(tensor_checksum(swapped), tensor_checksum(x))  # the weighted sum sees order
    assert torch.equal(tensor_checksum(x[:0]), torch.zeros(2, dtype=torch.int64))


def test_combined_checksum_sees_swapped_inputs_and_a_change_in_any() -> None:
    a, b = torch.arange(8.0), torch.arange(8.0) + 1
    both = combine_checksums([tensor_checksum(a), tensor_checksum(b)])
    assert not torch.equal(both, combine_checksums([tensor_checksum(b), tensor_checksum(a)]))
    bigger = b.clone()
    bigger[0] = -0.0  # other bits than 0.0 (its value compares equal): inputs are compared exactly
    b0 = b.clone()
    b0[0] = 0.0
    assert not torch.equal(
        combine_checksums([tensor_checksum(a), tensor_checksum(bigger)]),
        combine_checksums([tensor_checksum(a), tensor_checksum(b0)]),
    )
    assert combine_checksums([]).tolist() == [0, 0]


def _values_worker(rank: int, world: int) -> dict[str, Any]:
    """tp 2 x dp 2: plans [0, 1] and [2, 3]; each replica draws its own batch, the same on its ranks."""
    torch.manual_seed(0)
    ref = Ref()
    pm = Gen(rank, world, plan=2)
    pm.load_merged_state_dict({**ref.state_dict(), "freq": ref.freq})
    g = torch.Generator().manual_seed(10 + rank // 2)
    x, t = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
    out: dict[str, Any] = {}
    with torch.no_grad():
        out["loss"], out["want"] = float(pm(x, t)), float(ref(x, t))  # replicas differ: not compared

        def one_element(v: torch.Tensor) -> None:
            v[3, 2] += 1e-3

        def swapped_rows(v: torch.Tensor) -> None:
            v[[0, 1]] = v[[1, 0]]

        for name, change in (("one_element", one_element), ("swapped_rows", swapped_rows)):
            xx, tt = x.clone(), t.clone()
            if rank == 1:  # rank 1 of the first plan gets another batch of the same shape
                change(xx)
                change(tt)
            start = time.monotonic()
            try:
                pm(xx, tt)
                out[name] = "no error"
            except ValueError as exc:
                out[name] = str(exc)
            out[f"{name}_s"] = time.monotonic() - start
        pm.check_input_values = False  # shapes only: rank 1's other values are not seen
        xx = x.clone()
        if rank == 1:
            one_element(xx)
        pm(xx, t)
        pm.check_input_values = True
        out["after"] = float(pm(x, t))  # the ranks are still in step
    return out


def test_plan_ranks_with_other_values_raise_replicas_pass() -> None:
    results = run_dist(_values_worker, 4, timeout=120)
    for rank, out in enumerate(results):
        assert out["loss"] == pytest.approx(out["want"], rel=1e-5), rank
        assert out["after"] == out["loss"], rank
        for name in ("one_element", "swapped_rows"):
            msg = out[name]
            if rank >= 2:  # the second plan's ranks got equal values
                assert msg == "no error", (rank, msg)
                continue
            assert "Gen.forward: the ranks that run one copy of the plan (global ranks [0, 1])" in msg
            assert "same shapes but different values: x differs: rank 0 has one value, rank 1 another" in msg
            assert "(also different: t)" in msg
            assert "rank // plan_ngpus" in msg and "check_input_values = False" in msg
            assert out[f"{name}_s"] < 5.0, (rank, name, out[f"{name}_s"])
