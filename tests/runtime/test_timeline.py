"""The communication timeline (runtime/timeline.py): NNSCALER_TIMELINE on 2 gloo ranks writes Chrome
trace JSON whose events are the collectives and P2P ops the ranks issued, with their bytes."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from nnscaler import ComputeConfig
from nnscaler.runtime.dist import timeline

try:
    from .dist_util import run_dist
    from .test_module import Gen, _setup
    from .test_reducer import TINY_MB
except ImportError:
    from dist_util import run_dist
    from test_module import Gen, _setup
    from test_reducer import TINY_MB


def timeline_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    os.environ[timeline.ENV] = path
    import nnscaler

    original = dist.all_reduce
    nnscaler.init()  # the group is up: init only starts the timeline
    assert dist.all_reduce is not original, "the timeline records torch.distributed.all_reduce"
    _, full, x, t = _setup()
    pm = Gen(rank, world, 1, init_params=False)
    pm.compute_config = ComputeConfig(1, world, reducer_bucket_cap_mb=TINY_MB)
    pm.load_merged_state_dict(full)
    for _ in range(2):
        pm(x, t).backward()
        pm.sync_grad()
        pm.zero_grad()
    buckets = [b.size * b.grads.element_size() for b in pm.reducer.buckets]
    # one P2P exchange: 3 floats from rank 0 to rank 1
    payload = torch.arange(3, dtype=torch.float32)
    work = dist.isend(payload, 1) if rank == 0 else dist.irecv(payload, 0)
    work.wait()
    dist.barrier()
    nnscaler.uninit()  # writes this rank's file (the process then exits without running atexit)
    return {"buckets": buckets}


def test_timeline_is_chrome_trace_of_every_collective(tmp_path: Any) -> None:
    path = str(tmp_path / "trace.json")
    results = run_dist(timeline_worker, 2, path)
    files = sorted(glob.glob(str(tmp_path / "trace.rank*.json")))
    assert [os.path.basename(f) for f in files] == ["trace.rank0.json", "trace.rank1.json"]
    merged = timeline.merge_timelines(files, str(tmp_path / "all.json"))
    with open(tmp_path / "all.json") as f:
        assert json.load(f) == merged  # valid JSON on disk, as Perfetto reads it
    events = merged["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert isinstance(e["ts"], float) and e["dur"] >= 0 and e["pid"] in (0, 1), e
        assert "unfinished" not in e["args"], f"an op never completed: {e}"
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        reduces = [e for e in mine if e["name"] == "all_reduce" and e["args"]["group"] == [0, 1]]
        # every bucket is all-reduced once per step, with its bytes
        want = sorted(results[rank]["buckets"] * 2)
        assert sorted(e["args"]["bytes"] for e in reduces) == want, rank
        p2p = [e for e in mine if e["cat"] == "p2p"]
        assert [(e["name"], e["args"]["peer"], e["args"]["bytes"]) for e in p2p] == [
            ("isend", 1, 12) if rank == 0 else ("irecv", 0, 12)
        ]
        tracks = {e["tid"] for e in mine}
        threads = {
            e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == rank
        }
        assert tracks <= threads, "every track is named"


def test_scoped_timeline_restores_torch_distributed(tmp_path: Any) -> None:
    before = dist.all_reduce
    with timeline.timeline(str(tmp_path / "t.json")):
        assert dist.all_reduce is not before
    assert dist.all_reduce is before
    with open(tmp_path / "t.rank0.json") as f:
        assert json.load(f)["traceEvents"][0]["ph"] == "M"


def test_pipeline_timeline_has_steps_sends_and_receives(tmp_path: Any, monkeypatch: Any) -> None:
    """A 2-stage pipeline over 2 ranks under NNSCALER_TIMELINE (the children inherit it): each rank's
    file holds its train_step spans and the activations / gradients it sent and received."""
    from tests.parity import run_parity

    monkeypatch.setenv(timeline.ENV, str(tmp_path / "pp-{rank}.json"))
    nmicros = 2
    run_parity(
        "gpt",
        "pp",
        2,
        2,
        steps=2,
        tmp_path=tmp_path,
        nmicros=nmicros,
        config_kwargs={"use_end2end": True, "pas_config": {"pipeline_nmicros": nmicros}},
    )
    for rank in (0, 1):
        with open(tmp_path / f"pp-{rank}.json") as f:
            spans = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        assert [e["name"] for e in spans if e["cat"] == "step"].count("train_step") == 2
        p2p = [e for e in spans if e["cat"] == "p2p" and e["name"] in ("isend", "irecv")]
        peer = 1 - rank
        # per step and micro-batch: stage 0 sends activations and receives their gradients; stage 1
        # the reverse (the same bytes both ways)
        kinds = sorted(e["name"] for e in p2p if e["args"]["peer"] == peer)
        assert kinds == ["irecv"] * 2 * nmicros + ["isend"] * 2 * nmicros, kinds
        assert all(e["args"]["bytes"] > 0 and "unfinished" not in e["args"] for e in p2p)
