"""NCCL-like strict P2P mode on gloo (NNSCALER_STRICT_P2P=1): the generated 1F1B and interleaved
schedules pass parity with every send synchronous and every message's position in its rank pair
checked; a misordered exchange (the old unpaired 1F1B order) fails naming the pair and both ops."""

from __future__ import annotations

import pytest
import torch

from nnscaler.runtime.dist.p2p import P2P, STRICT_ENV, TIMEOUT_ENV, Label, P2POrderError
from tests.dist_util import SpawnError, spawn
from tests.parity import run_parity

NMICROS = 4

CASES = {
    # id: (model, policy, plan_ngpus, runtime_ngpus, extra pas_config)
    "gpt-pp2-1f1b": ("gpt", "pp", 2, 2, {"pipeline_scheduler": "1f1b"}),
    "gpt-pp4-1f1b": ("gpt_deep", "pp", 4, 4, {"pipeline_scheduler": "1f1b"}),
    "gpt-pp2x2-interleaved": ("gpt_deep", "pp", 2, 2, {"pipeline_scheduler": "1f1b_interleaved"}),
    "gpt-pp4x2-interleaved": ("gpt_deep", "pp", 4, 4, {"pipeline_scheduler": "1f1b_interleaved"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_parity_in_strict_p2p_mode(case, tmp_path, monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")  # the spawned ranks inherit it
    model, policy, plan, runtime, extra = CASES[case]
    run_parity(
        model,
        policy,
        plan,
        runtime,
        steps=1,
        tmp_path=tmp_path,
        nmicros=NMICROS,
        config_kwargs={"use_end2end": True, "pas_config": {"pipeline_nmicros": NMICROS, **extra}},
    )


def _unpaired_1f1b(rank: int, world_size: int) -> None:
    """Rank 0 issues [send F0, send F1, recv B0], rank 1 [recv F0, send B0, recv F1]: a hang on NCCL."""
    p2p = P2P(torch.device("cpu"), strict=True)
    t = torch.zeros(4)
    if rank == 0:
        p2p.send(t, 1, Label("F", 1, 0, 0))
        p2p.send(t, 1, Label("F", 1, 1, 0))
        p2p.recv(torch.empty(4), 1, Label("B", 1, 0, 0)).wait()
    else:
        p2p.recv(torch.empty(4), 0, Label("F", 1, 0, 0)).wait()
        p2p.send(t, 0, Label("B", 1, 0, 0))
        p2p.recv(torch.empty(4), 0, Label("F", 1, 1, 0)).wait()
    p2p.finish()


def test_strict_mode_catches_the_unpaired_1f1b_order(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    with pytest.raises(SpawnError) as info:
        spawn(_unpaired_1f1b, 2, tmp_path, timeout=60)
    text = str(info.value)
    assert P2POrderError.__name__ in text
    # each side's send waits for a receive the other posts only after its own send: NCCL hangs here
    assert "was not received within 3 s" in text
    assert "send of activation 0 of stage 1 micro-batch 1 to rank 1 (op 1 of the pair 0-1)" in text


def _swapped(rank: int, world_size: int) -> None:
    """Two messages of equal size received in the other order: gloo would silently swap them."""
    p2p = P2P(torch.device("cpu"), strict=True)
    if rank == 0:
        p2p.send(torch.zeros(4), 1, Label("F", 1, 0, 0))
        p2p.send(torch.ones(4), 1, Label("F", 1, 1, 0))
    else:
        w1 = p2p.recv(torch.empty(4), 0, Label("F", 1, 1, 0))
        w0 = p2p.recv(torch.empty(4), 0, Label("F", 1, 0, 0))
        w1.wait()
        w0.wait()
    p2p.finish()


def test_strict_mode_names_both_ops_of_a_swapped_pair(tmp_path):
    with pytest.raises(SpawnError) as info:
        spawn(_swapped, 2, tmp_path, timeout=60)
    text = str(info.value)
    assert "P2P order mismatch between ranks 0 and 1 at op 0" in text
    assert "activation 0 of stage 1 micro-batch 1" in text  # what rank 1 expected
    assert "rank 0 issued op 0: send of activation 0 of stage 1 micro-batch 0" in text


def _paired_1f1b(rank: int, world_size: int) -> list[float]:
    """The agreed order: rank 1 posts F0 and F1 before sending B0 (what the generated code does)."""
    p2p = P2P(torch.device("cpu"), strict=True)
    if rank == 0:
        p2p.send(torch.full((4,), 1.0), 1, Label("F", 1, 0, 0))
        p2p.send(torch.full((4,), 2.0), 1, Label("F", 1, 1, 0))
        got = torch.empty(4)
        p2p.recv(got, 1, Label("B", 1, 0, 0)).wait()
        out = [got[0].item()]
    else:
        f0, f1 = torch.empty(4), torch.empty(4)
        w0 = p2p.recv(f0, 0, Label("F", 1, 0, 0))
        w1 = p2p.recv(f1, 0, Label("F", 1, 1, 0))
        w0.wait()
        p2p.send(torch.full((4,), 3.0), 0, Label("B", 1, 0, 0))
        w1.wait()
        out = [f0[0].item(), f1[0].item()]
    p2p.finish()
    return out


def test_strict_mode_passes_the_agreed_order(tmp_path):
    assert spawn(_paired_1f1b, 2, tmp_path, timeout=60) == [[3.0], [1.0, 2.0]]
