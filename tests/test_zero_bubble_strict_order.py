"""Strict P2P mode (NNSCALER_STRICT_P2P) catches a misordered zero-bubble P2P program at run time
(issue 44): zb_h1's ops on 2 gloo ranks issued with each receive posted only just before its use
(the naive order): rank 1's first gradient send meets rank 0's second activation send, both waiting
for a receive, which hangs NCCL; strict mode raises P2POrderError instead."""

from __future__ import annotations

import pytest
import torch

from nnscaler.policies.p2p_plan import Post, Send, Wait, group_program, unpaired_program
from nnscaler.runtime.dist.p2p import P2P, TIMEOUT_ENV, Label, P2POrderError
from tests.dist_util import SpawnError, spawn


def _run_program(rank: int, world_size: int, agreed: bool) -> int:
    """Issue zb_h1's P2P ops on 2 ranks, 4 micro-batches, in the agreed or the unpaired order."""
    make = group_program if agreed else unpaired_program  # unpaired: each receive posted just before use
    p2p = P2P(torch.device("cpu"), strict=True)
    posted, received = {}, 0
    for step in make("zb_h1", 2, 2, 4, rank):
        if isinstance(step, (Post, Send, Wait)):
            label = Label(step.msg.kind, step.msg.stage, step.msg.micro, 0)
        if isinstance(step, Post):
            posted[step.msg] = p2p.recv(torch.empty(4), step.peer, label)
        elif isinstance(step, Wait):
            posted.pop(step.msg).wait()
            received += 1
        elif isinstance(step, Send):
            p2p.send(torch.zeros(4), step.peer, label)
    p2p.finish()
    return received


def test_strict_mode_catches_a_misordered_zb_h1_program(tmp_path, monkeypatch):
    """(The agreed order runs in strict mode in test_zero_bubble_strict.py's parity.)"""
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    with pytest.raises(SpawnError) as info:
        spawn(_run_program, 2, tmp_path, False, timeout=60)
    assert P2POrderError.__name__ in str(info.value)
    assert "was not received within 3 s" in str(info.value)
