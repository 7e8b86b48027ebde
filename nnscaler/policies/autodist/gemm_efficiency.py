"""Sustained matmul efficiency by GPU generation and GEMM size, and the clock / power caps of a device.

The cost model (cost.compute_time) times a matmul-like op (linear, bmm, attention, conv) as
FLOPs / (peak x fraction), the fraction depending on the device kind and on the FLOPs of one call:

    fraction(F) = large x F / (F + half_gflops x 1e9)

`large` is what big GEMMs sustain end to end inside a training step (kernel efficiency, the
non-overlapped epilogues and the memory-bound work fused around them); `half_gflops` is the size of
one call at which a GEMM sustains half of that. The form is a fixed time per call on top of the ideal
one (half_gflops / (peak x large) seconds): the partial last wave of output tiles, the pipeline fill of
each tile's K loop and the launch, which do not shrink with the GEMM. A 4096 x 4096 x 4096 GEMM is
137 GFLOP, a Llama-3-8B layer's MLP up projection at 8K tokens 481 GFLOP; a small model's attention
projections at micro-batch 1 are a few GFLOP and pay the tail.

Sources of the priors (then fitted, see GEMM_TABLE):
- cuBLAS bf16 GEMM throughput on square sizes, as commonly reported (NVIDIA's cuBLAS / CUTLASS
  profiler figures and public re-measurements such as ml-engineering's `mamf-finder` tables; the
  figures here are approximate and were not re-measured: no GPU was used): A100 SXM reaches about
  80-88% of its 312 TFLOP/s on large GEMMs, ~65-70% at 2048^3 and ~40% at 1024^3; H100 SXM ~70-80% of
  989 TFLOP/s on large GEMMs (its power limit lowers the clock under sustained tensor load), ~55% at
  2048^3 and ~25% at 1024^3. These give half_gflops of about 2-4 (A100) and 4-13 (H100): 3 and 8 here.
- End-to-end MFU of published runs (benchmarks/published_runs.yaml): `large` fitted on its `calibrate`
  rows (benchmarks/calibrate_published.py), the `held_aside` rows reported apart
  (benchmarks/cost_model_vs_published.py). `half_gflops` stays at the kernel figures above: the
  published runs' GEMMs are all large and hardly constrain it (freed, the fit put it at 13 for the
  A100 and 0 for the H100). The fitted H100 `large` (0.565) is below the cuBLAS figure: the H100 runs
  of the table (llm-foundry 2023, torchtitan without torch.compile at 500 W, Llama 3) sustain less of
  the peak end to end than the A100 runs (Megatron, llm-foundry, torchtitan) do of theirs.

Clock and power caps (cluster file `device: {name: h100, clock_mhz: 1500}` or `power_w: 500`) scale the
compute peak (not the memory bandwidth) by clock_scale: clock_mhz / the kind's boost clock, and for a
power cap (power_w / TDP)^(1/3), dynamic power growing about as the cube of the clock when the
voltage follows it (an approximation: static power and memory power are ignored, so a deep cap is
predicted somewhat too fast). Both at or above the nominal figures leave the peak as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GemmCurve", "GEMM_TABLE", "NOMINAL", "matmul_fraction", "clock_scale"]


@dataclass(frozen=True)
class GemmCurve:
    """The sustained matmul fraction of one device kind (see the module docstring)."""

    large: float
    """Fraction of the dense peak that large GEMMs sustain in a training step."""
    half_gflops: float
    """GFLOPs of one call at which a GEMM sustains half of `large` (0: no size dependence)."""


GEMM_TABLE: dict[str, GemmCurve] = {
    # Fitted by benchmarks/calibrate_published.py on the `calibrate` rows of
    # benchmarks/published_runs.yaml (FIT_NOTE); priors were a100 0.80, h100 0.72 (cuBLAS).
    "a100": GemmCurve(large=0.73, half_gflops=3.0),
    "h100": GemmCurve(large=0.565, half_gflops=8.0),
    # Same silicon as the H100 (more, faster memory): the H100 curve.
    "h200": GemmCurve(large=0.565, half_gflops=8.0),
    # Not calibrated (no published run in the table): AMD's hipBLASLt figures put large bf16 GEMMs at
    # about 55-65% of the 1307 TFLOP/s peak.
    "mi300x": GemmCurve(large=0.6, half_gflops=10.0),
    # A 2-core CPU share: no size effect modelled (measured order of magnitude, devices.py).
    "cpu": GemmCurve(large=0.5, half_gflops=0.0),
}
"""GEMM efficiency per device kind."""

FIT_NOTE = (
    "benchmarks/calibrate_published.py --fit-overlap (large and OverlapModel.intra_node; half_gflops at "
    "the kernel figures), 2026-11-28: 14 calibrate rows of published_runs.yaml (10 A100, 4 H100), the "
    "1F1B / interleaved pipeline timing, fused GELU and attention in the costed graphs: a100 large 0.73, "
    "h100 large 0.565, intra_node overlap 0.0 (calibrate median error 4.8%, worst 13.6%; held-aside "
    "median 5.6%, worst 28.7%: MT-NLG's 2021 run)"
)
"""Which fit produced GEMM_TABLE's a100 / h100 rows."""

NOMINAL: dict[str, tuple[float, float]] = {
    "a100": (1410.0, 400.0),  # A100 SXM4: boost clock MHz, TDP W (NVIDIA A100 datasheet)
    "h100": (1980.0, 700.0),  # H100 SXM5 (NVIDIA H100 datasheet)
    "h200": (1980.0, 700.0),  # H200 SXM
    "mi300x": (2100.0, 750.0),  # AMD Instinct MI300X datasheet
    "cpu": (0.0, 0.0),  # no caps modelled
}
"""(boost clock MHz, board power W) the device table's peaks are quoted at."""


def matmul_fraction(large: float, half_gflops: float, flops: float) -> float:
    """Fraction of the peak a matmul of `flops` FLOPs per call sustains (module docstring)."""
    if half_gflops <= 0 or flops <= 0:
        return large
    return large * flops / (flops + half_gflops * 1e9)


def clock_scale(kind: str, clock_mhz: float | None, power_w: float | None) -> float:
    """Factor on the compute peak of device `kind` run at `clock_mhz` and/or capped at `power_w`
    (None: not set); 1 at or above the nominal figures and for kinds without them."""
    boost, tdp = NOMINAL.get(kind, (0.0, 0.0))
    scale = 1.0
    if clock_mhz is not None and boost > 0:
        scale = min(scale, clock_mhz / boost)
    if power_w is not None and tdp > 0:
        scale = min(scale, (min(power_w, tdp) / tdp) ** (1.0 / 3.0))
    return scale
