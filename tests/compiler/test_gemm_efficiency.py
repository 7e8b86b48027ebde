"""Matmul efficiency by GPU generation and GEMM size, and clock / power caps (issue 42): hand-computed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nnscaler.errors import ConfigError
from nnscaler.policies.autodist import load_cluster
from nnscaler.policies.autodist.cost import CostContext, compute_time
from nnscaler.policies.autodist.devices import DEVICES
from nnscaler.policies.autodist.gemm_efficiency import GEMM_TABLE, clock_scale, matmul_fraction


def _cluster(device):
    return load_cluster({"device": device, "nodes": 1, "devices_per_node": 8})


def _compute_s(device, flops: float, nbytes: float = 0.0) -> float:
    ctx = CostContext(_cluster(device), training=False)
    return compute_time(flops, nbytes, ctx, "bfloat16", matmul=True)


def test_the_fraction_is_large_times_flops_over_flops_plus_half():
    assert matmul_fraction(0.8, 4.0, 4e9) == pytest.approx(0.4)
    assert matmul_fraction(0.8, 4.0, 12e9) == pytest.approx(0.6)
    assert matmul_fraction(0.8, 0.0, 1e3) == 0.8  # no size effect


def test_a_small_gemm_is_slower_per_flop_than_a_large_one_on_the_same_device():
    for kind in ("a100", "h100"):
        dev = DEVICES[kind]
        small, large = 2e9, 2e12  # a 1024^3 GEMM, a 10000^3 one
        per_flop_small = _compute_s(kind, small) / small
        per_flop_large = _compute_s(kind, large) / large
        assert per_flop_small > 1.5 * per_flop_large
        # hand computation: FLOPs / (peak x large x F / (F + half)) + launch
        half = dev.gemm_half_gflops * 1e9
        want = small / (dev.bf16_tflops * 1e12 * dev.matmul_efficiency * small / (small + half))
        assert _compute_s(kind, small) == pytest.approx(want + dev.kernel_overhead_us * 1e-6)


def test_a100_and_h100_have_their_own_curves():
    a, h = GEMM_TABLE["a100"], GEMM_TABLE["h100"]
    assert (a.large, a.half_gflops) != (h.large, h.half_gflops)
    assert DEVICES["a100"].matmul_efficiency == a.large and DEVICES["h100"].gemm_half_gflops == h.half_gflops
    f = 50e9
    assert _compute_s("a100", f) != pytest.approx(_compute_s("h100", f) * 989 / 312)


def test_the_cluster_file_overrides_the_table():
    dev = _cluster({"name": "h100", "matmul_efficiency": 0.5, "gemm_half_gflops": 0}).device
    assert dev.matmul_fraction(1e6) == 0.5 and dev.matmul_fraction(1e15) == 0.5


def test_half_the_clock_doubles_the_compute_part():
    f = 1e13  # compute-bound: bytes 0
    full = _compute_s("h100", f) - DEVICES["h100"].kernel_overhead_us * 1e-6
    half = _compute_s({"name": "h100", "clock_mhz": 990}, f) - DEVICES["h100"].kernel_overhead_us * 1e-6
    assert half == pytest.approx(2 * full)


def test_the_clock_cap_leaves_memory_bound_ops_alone():
    nbytes = 1e10  # 10 GB moved, 1 FLOP: bandwidth-bound
    assert _compute_s({"name": "h100", "clock_mhz": 990}, 1.0, nbytes) == pytest.approx(
        _compute_s("h100", 1.0, nbytes)
    )


def test_a_power_cap_scales_the_peak_by_the_cube_root_of_the_power_share():
    dev = _cluster({"name": "h100", "power_w": 500}).device
    assert dev.clock_scale == pytest.approx((500 / 700) ** (1 / 3))
    assert dev.tflops("bfloat16") == pytest.approx(989 * (500 / 700) ** (1 / 3))
    assert clock_scale("h100", None, 800) == 1.0  # above the TDP: the datasheet peak
    assert clock_scale("a100", 705, 400) == pytest.approx(0.5)  # the tighter of the two


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("clock_mhz", 0, "> 0"),
        ("clock_mhz", "fast", "must be a number"),
        ("power_w", -300, "> 0"),
        ("gemm_half_gflops", -1, ">= 0"),
    ],
)
def test_a_bad_cap_is_refused_naming_the_field(field, value, words):
    with pytest.raises(ConfigError, match=rf"device\.{field}.*{words}|{words}.*device\.{field}"):
        _cluster({"name": "a100", field: value})


def test_caps_carry_through_replace():
    dev = replace(DEVICES["a100"], clock_mhz=1410 / 2)
    assert dev.tflops("bfloat16") == pytest.approx(156.0)
