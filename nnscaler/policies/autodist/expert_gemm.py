"""The compute time of a mixture-of-experts layer's experts op (`nnscaler::moe_experts`) on one rank:
a roofline per grouped GEMM with a small-GEMM efficiency, instead of the single whole-op roofline of
cost.compute_time (which made fine-grained experts split by tp look as fast as whole experts).

The op runs each GEMM once over all its local experts (`torch._grouped_mm`, runtime/moe/experts.py),
expert e on its M rows (balanced routing: M = rows / E_local, rows = the rank's token-expert
assignments):

    forward   gate/up  [M, H] x [H, 2I]      down  [M, I] x [I, H]
    backward  dgrad    [M, 2I] x [2I, H]  and [M, H] x [H, I]
              wgrad    [2I, M] x [M, H]   and [H, M] x [M, I]

(I: the rank's share of the intermediate features, 1/tp when the experts are split on `i`). Each GEMM
(m x k) x (k x n) over G = E_local groups takes

    time = max(2 m n k G / (peak x matmul_efficiency x shape_efficiency),
               (m k + k n + m n) G x dtype bytes / (HBM bandwidth x mem_efficiency)) + launch

the bytes being the weights read (or their gradient written) and the rows in and out. `peak` and the
HBM bandwidth are the cluster's device figures (DeviceSpec.bf16_tflops, mem_bw_gbs, the efficiencies
and `compute_units`). The shape efficiency is what a tiled GEMM kernel loses on small dims:

- tile quantisation: Hopper GEMM kernels (CUTLASS / cuBLAS sm90 warp-specialised) compute output tiles
  of TILE_M x TILE_N = 128 x 256; a dim that is not a multiple wastes the padded part of its last tile
  (m = 64 rows of an expert run at 50%);
- wave quantisation: the tiles of all groups run in waves of `compute_units` (132 SMs on an H100 SXM);
  a partial last wave idles the rest;
- pipeline fill: each tile's main loop streams K in steps of 64 through a multi-stage pipeline whose
  prologue and epilogue cost about K_FILL = 128 of K: efficiency k / (k + K_FILL) (K = 256, a down
  projection of DeepSeek-V3's experts split by tp 8, runs at 2/3). K_FILL is an estimate (two of the
  64-deep K steps), not a measurement: no GPU has checked these constants yet.

Small GEMMs are thus memory-bound (weights read for few rows) or run on partly idle tiles, which is
why fine-grained experts (DeepSeek-V3: I = 2048) are kept whole and spread by expert parallelism.
Besides the GEMMs the op moves its rows (GLUE_ROW_ELEMS): the dispatch gathers each assignment's hidden
row (read and write H), the activation reads 2I and writes I, the combine reads H and adds it into the
token's row (H); the backward moves twice that. Without expert parallelism the op's backward first
runs its forward again (runtime/moe/op.py: it recomputes under autograd rather than saving the
intermediates), which is counted; under ep the experts run under plain autograd (runtime/moe/
dispatch.py). Measured profiles (ctx.measured) still take precedence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nnscaler.policies.autodist.devices import DeviceSpec

__all__ = ["TILE_M", "TILE_N", "K_FILL", "ExpertShapes", "shape_efficiency", "gemm_time", "experts_time"]

TILE_M, TILE_N = 128, 256
"""Output tile of Hopper bf16 GEMM kernels (CUTLASS sm90 default 128 x 256 x 64)."""
K_FILL = 128
"""K-equivalent of one tile's pipeline prologue and epilogue."""


@dataclass(frozen=True)
class ExpertShapes:
    """The experts op as one rank runs it."""

    rows: float
    """Token-expert assignments this rank computes (tokens x top-k, balanced over the experts)."""
    experts: int
    """Experts held by this rank (E / ep)."""
    hidden: int
    inter: int
    """Intermediate features per expert on this rank (I / tp when split on `i`)."""

    @property
    def m(self) -> float:
        """Rows per expert."""
        return self.rows / max(self.experts, 1)


def shape_efficiency(m: float, n: float, k: float, groups: int, units: float) -> float:
    """Fraction of the large-GEMM throughput a grouped GEMM of `groups` (m x k) x (k x n) keeps:
    tile quantisation x wave quantisation x pipeline fill (see the module docstring)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 1.0
    tm, tn = math.ceil(m / TILE_M), math.ceil(n / TILE_N)
    tile = (m * n) / (tm * TILE_M * tn * TILE_N)
    tiles = groups * tm * tn
    wave = tiles / (math.ceil(tiles / units) * units)
    return tile * wave * (k / (k + K_FILL))


def gemm_time(m: float, n: float, k: float, groups: int, dev: DeviceSpec, dtype: str, nbytes: int) -> float:
    """Roofline seconds of a grouped GEMM (one launch); `nbytes`: bytes per element."""
    eff = dev.matmul_efficiency * shape_efficiency(m, n, k, groups, dev.compute_units)
    flops = 2.0 * m * n * k * groups
    moved = (m * k + k * n + m * n) * groups * nbytes
    peak = dev.tflops(dtype) * 1e12
    bw = dev.mem_bw_gbs * 1e9 * dev.mem_efficiency
    compute = flops / (peak * eff) if eff > 0 else float("inf")
    return max(compute, moved / bw) + dev.kernel_overhead_us * 1e-6


GLUE_ROW_ELEMS = (4, 3)
"""Elements moved per row by the forward's non-GEMM kernels: 4 H (gather read + write, combine read +
add) + 3 I (activation: read 2I, write I)."""


def experts_time(
    s: ExpertShapes, dev: DeviceSpec, dtype: str, nbytes: int, training: bool, refwd: bool = False
) -> float:
    """Seconds of the experts op on one rank (forward, plus backward when `training`); `refwd`: the
    backward runs the forward again first (the op's own autograd, runtime/moe/op.py; not under ep)."""
    g, m, h, i = s.experts, s.m, s.hidden, s.inter
    fwd = [(m, 2 * i, h), (m, h, i)]
    bwd = [(m, h, 2 * i), (m, i, h), (2 * i, h, m), (h, i, m)]
    again = training and refwd
    gemms = fwd * (2 if again else 1) + (bwd if training else [])
    total = sum(gemm_time(a, b, c, g, dev, dtype, nbytes) for a, b, c in gemms)
    glue = s.rows * (GLUE_ROW_ELEMS[0] * h + GLUE_ROW_ELEMS[1] * i) * nbytes
    passes = (3 if training else 1) + (1 if again else 0)  # the backward moves twice the forward's rows
    glue_s = glue / (dev.mem_bw_gbs * 1e9 * dev.mem_efficiency) + dev.kernel_overhead_us * 1e-6
    return total + passes * glue_s
