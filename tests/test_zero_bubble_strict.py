"""Zero-bubble schedules in the NCCL-like strict P2P mode on gloo (NNSCALER_STRICT_P2P=1: every send
synchronous, every message's position in its rank pair checked): zb_h1, zbv and dualpipev run their
generated P2P order (in a V, the hand-over between a rank's two stages stays in memory) and keep
parity. A misordered one is caught (test_zero_bubble_strict_order.py, test_zero_bubble_schedules.py)."""

from __future__ import annotations

from nnscaler.runtime.dist.p2p import STRICT_ENV
from tests.parity import run_parity_many
from tests.test_zero_bubble_parity import zb_case


def test_zero_bubble_schedules_in_strict_p2p_mode(tmp_path, monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")  # the spawned ranks inherit it
    run_parity_many(
        [zb_case("gpt", "zb_h1", 4), zb_case("gpt_deep", "zbv", 4), zb_case("gpt_deep", "dualpipev", 4)],
        2,
        tmp_path=tmp_path,
        steps=1,
    )
