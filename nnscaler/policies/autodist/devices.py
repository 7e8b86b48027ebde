"""The device table: peak dense FLOP/s per dtype, memory bandwidth and memory size of each device kind.

Figures are vendor datasheet peaks for dense math (no 2:4 sparsity). The cost model applies the
`efficiency` fields on top: sustained matmul throughput and memory bandwidth are below the peaks. The
matmul efficiency of each kind and its dependence on GEMM size come from gemm_efficiency.GEMM_TABLE
(fitted on published runs); `clock_mhz` / `power_w` caps scale the compute peak (gemm_efficiency).
"""

from __future__ import annotations

from dataclasses import dataclass

from nnscaler.errors import ConfigError
from nnscaler.policies.autodist.gemm_efficiency import GEMM_TABLE, clock_scale, matmul_fraction

__all__ = ["DeviceSpec", "DEVICES", "get_device"]


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or a CPU socket share) as the cost model sees it."""

    name: str
    """Key in DEVICES (e.g. 'h100')."""
    bf16_tflops: float
    """Peak dense bf16/fp16 tensor throughput, TFLOP/s."""
    fp32_tflops: float
    """Peak dense fp32 throughput without TF32 tensor cores, TFLOP/s."""
    mem_bw_gbs: float
    """Memory (HBM / DRAM) bandwidth, GB/s (1e9 bytes/s)."""
    memory_gb: float
    """Memory per device, GB (1e9 bytes)."""
    matmul_efficiency: float = 0.7
    """Fraction of the peak that large matmuls sustain (gemm_efficiency.GEMM_TABLE per kind)."""
    gemm_half_gflops: float = 0.0
    """GFLOPs of one matmul call at which it sustains half of matmul_efficiency (0: no size effect;
    gemm_efficiency.GEMM_TABLE per kind)."""
    mem_efficiency: float = 0.8
    """Fraction of the memory bandwidth that elementwise kernels sustain."""
    kernel_overhead_us: float = 5.0
    """Fixed cost per op launch, microseconds."""
    compute_units: float = 132.0
    """Streaming multiprocessors (CUs) a GEMM's output tiles are spread over, one wave at a time (wave
    quantisation of small GEMMs, autodist/expert_gemm.py); default: an H100 SXM's 132."""
    clock_mhz: float | None = None
    """Locked or capped SM clock, MHz (None: the boost clock the peaks are quoted at)."""
    power_w: float | None = None
    """Board power cap, W (None: the kind's TDP); see gemm_efficiency.clock_scale."""

    @property
    def clock_scale(self) -> float:
        """Factor on the compute peaks from clock_mhz / power_w (1 without caps)."""
        return clock_scale(self.name, self.clock_mhz, self.power_w)

    def tflops(self, dtype: str) -> float:
        """Peak TFLOP/s for a tensor dtype name ('float32', 'bfloat16', 'torch.float16', ...), under the
        device's clock / power cap."""
        d = dtype.replace("torch.", "")
        peak = self.bf16_tflops if d in ("bfloat16", "float16", "half") else self.fp32_tflops
        return peak * self.clock_scale

    def matmul_fraction(self, flops: float) -> float:
        """Fraction of the peak a matmul of `flops` FLOPs per call sustains (gemm_efficiency)."""
        return matmul_fraction(self.matmul_efficiency, self.gemm_half_gflops, flops)


def _curve(kind: str) -> dict:
    c = GEMM_TABLE[kind]
    return {"matmul_efficiency": c.large, "gemm_half_gflops": c.half_gflops}


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        "h100", bf16_tflops=989.0, fp32_tflops=67.0, mem_bw_gbs=3350.0, memory_gb=80.0, **_curve("h100")
    ),
    "h200": DeviceSpec(
        "h200", bf16_tflops=989.0, fp32_tflops=67.0, mem_bw_gbs=4800.0, memory_gb=141.0, **_curve("h200")
    ),
    "a100": DeviceSpec(
        "a100",
        bf16_tflops=312.0,
        fp32_tflops=19.5,
        mem_bw_gbs=2039.0,
        memory_gb=80.0,
        compute_units=108.0,
        **_curve("a100"),
    ),
    "mi300x": DeviceSpec(
        "mi300x",
        bf16_tflops=1307.0,
        fp32_tflops=163.4,
        mem_bw_gbs=5300.0,
        memory_gb=192.0,
        compute_units=304.0,
        **_curve("mi300x"),
    ),
    # One share of a small x86 host (2 cores, AVX2): measured order of magnitude, not a datasheet.
    "cpu": DeviceSpec(
        "cpu",
        bf16_tflops=0.05,
        fp32_tflops=0.1,
        mem_bw_gbs=10.0,
        memory_gb=8.0,
        kernel_overhead_us=20.0,
        compute_units=2.0,
        **_curve("cpu"),
    ),
}
"""Known device kinds by name."""

_ALIASES = {"h100_sxm": "h100", "h100-sxm": "h100", "a100_80gb": "a100", "mi300": "mi300x"}


def get_device(name: str) -> DeviceSpec:
    """The DeviceSpec called `name` (case-insensitive); ConfigError listing the known ones otherwise."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise ConfigError(f"unknown device {name!r} in the cluster description: use one of {sorted(DEVICES)}")
    return DEVICES[key]
