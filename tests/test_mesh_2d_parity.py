"""2-D splits: ops split on two identifiers over a 2 x 2 mesh (the batch over axis 0, Megatron's split
over axis 1) train like the single-device model, at the traced shapes and at others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.mesh2d_policy import data_x_tp
from tests.parity import run_parity


def _plan_of(tmp_path: Path) -> dict:
    (path,) = list((tmp_path / "gen").rglob("plan.json"))
    return json.loads(path.read_text())


def _gencode(tmp_path: Path, rank: int) -> str:
    (path,) = list((tmp_path / "gen").rglob(f"gencode{rank}.py"))
    return path.read_text()


@pytest.mark.parametrize(
    "model, shapes",
    [
        ("mlp", None),
        ("gpt", [(4, None), (8, 8), (2, 12)]),  # other batch sizes and sequence lengths than traced
        ("llama", [(4, None), (6, 8)]),
    ],
)
def test_data_x_tp_parity(model, shapes, tmp_path):
    run_parity(model, data_x_tp, 4, 4, steps=2, tmp_path=tmp_path, shapes=shapes)
    plan = _plan_of(tmp_path)
    assert plan["mesh"] == [2, 2]
    both = [
        n for n, p in plan["nodes"].items() if all(ident for ident, _ in p.get("mesh_splits", [[None, 1]]))
    ]
    assert len(both) >= 3, "the policy should split some ops on two identifiers at once"
    code = _gencode(tmp_path, 1)
    assert '"tp_axis0": [1, 3], "tp_axis1": [0, 1]' in code
    assert "comm.copy_to_group(" in code and ", tp_axis0)" in code


def test_data_x_tp_with_data_parallel_replicas_sgd(tmp_path):
    """plan 4 (2 x 2) x 2 replicas with ZeRO; SGD so parameters are compared tightly."""
    run_parity(
        "mlp", data_x_tp, 4, 8, steps=2, tmp_path=tmp_path, optimizer="sgd", config_kwargs={"use_zero": True}
    )


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "barrier",
)


def _record_collectives(rank: int, world_size: int, gen_savedir: str) -> list[tuple[str, tuple[int, ...]]]:
    """One training step of gpt under data_x_tp, recording every collective this rank issues."""
    import torch.distributed as dist

    import nnscaler
    from nnscaler import ComputeConfig, parallelize
    from tests import zoo

    nnscaler.init()
    model, make_batch = zoo.build("gpt", seed=0)
    pm = parallelize(model, make_batch(0, 4), data_x_tp, ComputeConfig(4, 4), gen_savedir=gen_savedir)
    issued: list[tuple[str, tuple[int, ...]]] = []
    for name in _COLLECTIVES:
        real = getattr(dist, name)

        def record(*args, _real=real, _name=name, **kwargs):
            group = kwargs.get("group")
            ranks = (
                tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world_size))
            )
            issued.append((_name, ranks))
            return _real(*args, **kwargs)

        setattr(dist, name, record)
    loss = zoo.extract_loss(pm(**make_batch(1, 4)))
    loss.backward()
    return issued


def _simulate_blocking(issued: list[list[tuple[str, tuple[int, ...]]]]) -> None:
    """NCCL's rule, strictly: a collective runs only once every member of its group has it next; every
    collective blocks its rank until then. Fails on a mismatch or a deadlock."""
    heads = [0] * len(issued)
    while any(h < len(seq) for h, seq in zip(heads, issued)):
        progressed = False
        for rank, seq in enumerate(issued):
            if heads[rank] >= len(seq):
                continue
            op, ranks = seq[heads[rank]]
            nexts = [issued[r][heads[r]] if heads[r] < len(issued[r]) else None for r in ranks]
            if all(n == (op, ranks) for n in nexts):
                for r in ranks:
                    heads[r] += 1
                progressed = True
        if not progressed:
            state = {r: (seq[heads[r]] if heads[r] < len(seq) else "done") for r, seq in enumerate(issued)}
            raise AssertionError(f"collectives would deadlock under NCCL; next on each rank: {state}")


def test_2d_collectives_issue_in_one_order(tmp_path):
    from tests.dist_util import spawn

    issued = spawn(_record_collectives, 4, tmp_path, str(tmp_path / "gen"))
    axis_groups = {ranks for seq in issued for _, ranks in seq if len(ranks) == 2}
    assert {(0, 2), (1, 3), (0, 1), (2, 3)} <= axis_groups  # both mesh axes communicate
    _simulate_blocking(issued)
    # and the check can fail: swap two collectives on different groups on one rank
    bad = [list(seq) for seq in issued]
    i = next(i for i in range(len(bad[0]) - 1) if bad[0][i][1] != bad[0][i + 1][1])
    bad[0][i], bad[0][i + 1] = bad[0][i + 1], bad[0][i]
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate_blocking(bad)


def test_autodist_2d_plan_parity(tmp_path):
    """autodist's own 2-D choice (TokenFFN on a bandwidth-bound cluster) trains like one device."""
    from tests.mesh2d_policy import SLOW_LINK_CLUSTER

    run_parity(
        "tests.mesh2d_policy:build_token_ffn",
        "autodist",
        4,
        4,
        steps=2,
        tmp_path=tmp_path,
        optimizer="sgd",
        config_kwargs={"pas_config": {"cluster": SLOW_LINK_CLUSTER}},
        shapes=[(4, None), (8, 128)],  # another batch and sequence length than traced
    )
    plan = _plan_of(tmp_path)
    assert plan["mesh"] == [2, 2]
    assert sum(1 for p in plan["nodes"].values() if p.get("mesh_splits")) >= 4
    (report,) = list((tmp_path / "gen").rglob("plan_report.md"))
    assert "2-D splits over a 2 x 2 mesh" in report.read_text()


def test_pipeline_stages_on_2x2_meshes_parity(tmp_path):
    """Two 1F1B stages, each split 2-D over its own 2 x 2 mesh (8 ranks)."""
    from tests.mesh2d_policy import two_stages_data_x_tp

    run_parity(
        "gpt",
        two_stages_data_x_tp,
        8,
        8,
        steps=2,
        tmp_path=tmp_path,
        nmicros=2,
        config_kwargs={"use_end2end": True, "pas_config": {"nmicros": 2}},
    )
    code = _gencode(tmp_path, 5)  # stage 1, mesh coordinates (0, 1)
    assert '"tp_axis0": [5, 7], "tp_axis1": [4, 5]' in code.replace("'", '"')
