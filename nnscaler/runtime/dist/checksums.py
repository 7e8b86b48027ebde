"""Checksums of tensor values, to compare inputs across ranks: exact, cheap, equal on every device.

A tensor's bytes are read as 64-bit words (zero-padded at the end) and summed twice in int64 with
wrap-around: the plain sum `s1` and `s2 = sum(cumsum)` (= sum of w[i] * (n - i), a position-weighted
sum); one cumsum gives both. Integer addition modulo 2**64 does not depend on the order of summation,
so equal tensors give equal checksums on every rank whatever the device, kernel or thread count
(float sums would not). A single changed element changes one word and so `s1`; values moved to other
positions change `s2`. Cost: one scan and one int64 temporary of the tensor's byte size, on the
tensor's own device: linear in the input's bytes, negligible for token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["tensor_checksum", "combine_checksums"]

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd multipliers that spread the tensors


def _bytes(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's data as flat bytes; None when it has no plain data (meta, sparse, quantized)."""
    if t.is_meta or t.layout != torch.strided or t.is_quantized or t.is_nested:
        return None
    return t.detach().reshape(-1).view(torch.uint8)


def _words(data: torch.Tensor) -> torch.Tensor:
    """Bytes (a multiple of 8) as int64 words; copied first when they do not start on an 8-byte boundary."""
    try:
        return data.view(torch.int64)
    except RuntimeError:
        return data.clone().view(torch.int64)


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """`[s1, s2]` (int64, on `t`'s device) of `t`'s values; zeros for an empty tensor or one without
    plain data (meta, sparse, quantized: their shapes are still compared)."""
    with torch.no_grad():
        data = _bytes(t)
        if data is None or data.numel() == 0:
            return torch.zeros(2, dtype=torch.int64, device=t.device)
        whole = data.numel() // 8 * 8
        s1 = s2 = torch.zeros((), dtype=torch.int64, device=t.device)
        if whole:
            running = _words(data[:whole]).cumsum(0)
            s1, s2 = running[-1], running.sum()
        if whole < data.numel():  # the last, partial word, zero-padded
            last = torch.zeros(8, dtype=torch.uint8, device=t.device)
            last[: data.numel() - whole] = data[whole:]
            s1 = s1 + last.view(torch.int64)[0]
            s2 = s2 + s1
        return torch.stack([s1, s2])


def combine_checksums(sums: Sequence[torch.Tensor]) -> torch.Tensor:
    """One `[2]` int64 CPU tensor for a list of `tensor_checksum`s: a sum weighted by an odd number per
    position (so a change in one stays a change, and swapped inputs differ). Each device's part crosses
    to the host once (on CUDA, that waits for the device); CPU tensors are never read on the host."""
    parts = [torch.zeros(2, dtype=torch.int64)]
    with torch.no_grad():
        for device in dict.fromkeys(s.device for s in sums):
            index = [i for i, s in enumerate(sums) if s.device == device]
            stacked = torch.stack([sums[i] for i in index])
            odd = (torch.tensor(index, dtype=torch.int64, device=device).add_(1).mul_(_GOLDEN)).bitwise_or_(1)
            part = (stacked * odd[:, None]).sum(0)
            parts.append(part if device.type == "cpu" else part.cpu())
        return torch.stack(parts).sum(0)
