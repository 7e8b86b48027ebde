"""ParallelModule + build_optimizer + checkpoints: a hand-written 'generated' module against its
single-device original, on 4 gloo ranks (tp 2 x dp 2) and in a plain process with no process group."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nnscaler.config import ComputeConfig
from nnscaler.runtime import (
    ParallelModule,
    broadcast_weights,
    build_optimizer,
    comm,
    deduped_state_dict,
    load_deduped_state_dict,
    load_merged_state_dict,
    load_sharded_state_dict,
    merge_state_dicts,
)

try:
    from .dist_util import run_dist
except ImportError:
    from dist_util import run_dist

D, H, BATCH, LR = 8, 6, 8, 1e-2


class Ref(nn.Module):
    """The user's single-device model: layer norm, fused 3-way projection, gated mix, projection back."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 3 * H)  # rows: [u | v | w], 3 blocks of H
        self.fc2 = nn.Linear(H, D)
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(D))
        self.register_buffer("offset", 0.1 * torch.randn(D))
        self.register_buffer("freq", torch.arange(D, dtype=torch.float32), persistent=False)
        self.head = nn.Linear(H, D, bias=False)
        self.head.weight = self.fc2.weight  # tied: two state-dict names, one parameter
        with torch.no_grad():
            self.ln.weight.add_(0.1 * torch.randn(D))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        u, v, w = self.fc1(self.ln(x)).chunk(3, dim=-1)
        y = self.fc2(F.gelu(u) * v + w) * self.scale + self.offset + 0.01 * self.freq
        return ((y - t) ** 2).mean()


class Gen(ParallelModule):
    """What the compiler would write for `Ref` under tensor parallelism over `plan` ranks."""

    def __init__(self, rank: int, world: int, plan: int, init_params: bool = True) -> None:
        base = rank // plan * plan
        super().__init__(
            rank=rank,
            world_size=world,
            plan_ngpus=plan,
            groups={"tp": list(range(base, base + plan)), "dp": list(range(rank % plan, world, plan))},
            all_groups=[list(range(s, s + plan)) for s in range(0, world, plan)]
            + [list(range(i, world, plan)) for i in range(plan)],
        )
        t, f32 = (rank + 1) % plan, torch.float32  # shard index != rank: pieces are matched by index
        # in the original state-dict order (merged optimizer state is ordered by registration)
        self.add_shard("scale", "scale", (D,), f32)
        self.add_shard("offset", "offset", (D,), f32, is_param=False)
        self.add_shard("freq", "freq", (D,), f32, is_param=False, persistent=False)
        self.add_shard("ln_weight", "ln.weight", (D,), f32)
        self.add_shard("ln_bias", "ln.bias", (D,), f32)
        self.add_shard("fc1_weight", "fc1.weight", (3 * H, D), f32, shard=(0, t, plan, 3))
        self.add_shard("fc1_bias", "fc1.bias", (3 * H,), f32, shard=(0, t, plan, 3))
        self.add_shard("fc2_weight", "fc2.weight", (D, H), f32, shard=(1, t, plan, 1))
        self.add_shard("fc2_bias", "fc2.bias", (D,), f32)
        self.add_alias("head.weight", "fc2.weight")
        self.load_shards(init_params)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tp = self.group("tp")
        h = comm.copy_to_group(F.layer_norm(x, (D,), self.ln_weight, self.ln_bias), tp)
        u, v, w = F.linear(h, self.fc1_weight, self.fc1_bias).chunk(3, dim=-1)  # this rank's third of each
        y = comm.reduce_from_group(F.linear(F.gelu(u) * v + w, self.fc2_weight), tp) + self.fc2_bias
        y = y * self.scale + self.offset + 0.01 * self.freq
        return ((y - t) ** 2).mean()


def _setup() -> tuple[Ref, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ref = Ref()
    full = {**ref.state_dict(), "freq": ref.freq}
    return ref, full, torch.randn(BATCH, D), torch.randn(BATCH, D)


def _close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _same_state(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert set(a) == set(b), f"{what}: keys {sorted(a)} != {sorted(b)}"
    for k in a:
        if isinstance(a[k], torch.Tensor):
            _close(a[k], b[k], f"{what}[{k}]")
        else:
            assert a[k] == b[k], f"{what}[{k}]: {a[k]} != {b[k]}"


def _same_opt(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert set(a["state"]) == set(b["state"]), f"{what}: parameters {set(a['state'])} != {set(b['state'])}"
    for i in a["state"]:
        _same_state(a["state"][i], b["state"][i], f"{what} state {i}")
    strip = [{k: v for k, v in g.items() if k != "param_names"} for g in a["param_groups"]]
    assert strip == [{k: v for k, v in g.items() if k != "param_names"} for g in b["param_groups"]], what


def _cpu(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _fresh(rank: int, world: int, plan: int) -> tuple[Gen, torch.optim.Optimizer]:
    pm = Gen(rank, world, plan, init_params=False)
    with torch.no_grad():
        for t in [*pm.parameters(), *pm.buffers()]:
            t.fill_(123.0)  # garbage, so nothing passes by accident
    return pm, build_optimizer(pm, torch.optim.AdamW, lr=LR, weight_decay=0.1)


def train_worker(rank: int, world: int) -> dict[str, Any]:
    plan = 2
    ref, full, x, t = _setup()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    pm = Gen(rank, world, plan, init_params=False)
    pm.compute_config = ComputeConfig(plan, world, reducer_bucket_cap_mb=1e-4)  # ~26 floats a bucket
    pm.load_merged_state_dict(full)
    opt = build_optimizer(pm, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    syncs = []
    sync_grad = pm.sync_grad
    pm.sync_grad = lambda: (syncs.append(1), sync_grad())[1]  # type: ignore[method-assign]
    rows = slice(rank // plan * BATCH // 2, (rank // plan + 1) * BATCH // 2)
    dp = pm.group("dp")
    for step in range(2):
        loss, ref_loss = pm(x[rows], t[rows]), ref(x, t)
        loss.backward()
        ref_loss.backward()
        if step == 1:  # replica-aware clipping, then the step must not sync again
            ref_norm = float(nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
            assert ref_norm > 0.05, "the test must actually clip"
            _close(float(pm.clip_gnorm(0.05)[0]), ref_norm, "clip_gnorm")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=dp)
        _close(mean_loss / dist.get_world_size(dp), ref_loss.detach(), f"loss at step {step}")
    assert len(syncs) == 2, f"gradients synced {len(syncs)} times in 2 steps"
    assert all(p.grad is None for p in pm.parameters())

    sd, opt_sd = _cpu(pm.state_dict()), copy.deepcopy(opt.state_dict())  # snapshots: training goes on
    # round trip on the same rank, and a clear error for another rank's state dict
    pm2, _ = _fresh(rank, world, plan)
    pm2.load_state_dict(sd)
    _same_state(pm2.state_dict(), sd, "state_dict round trip")
    wrong = {**sd, "_extra_state": {**sd["_extra_state"], "rank": (rank + 1) % world}}
    with pytest.raises(RuntimeError, match="merge_state_dicts"):
        pm2.load_state_dict(wrong)

    # merge on every rank, load under this plan, compare, and train one more step side by side
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (sd, opt_sd))
    merged, merged_opt = merge_state_dicts([s for s, _ in everyone], [o for _, o in everyone])
    pm3, opt3 = _fresh(rank, world, plan)
    load_merged_state_dict(pm3, {**merged, "freq": ref.freq}, opt3, merged_opt)
    _same_state(pm3.state_dict(), sd, "load_merged_state_dict model")
    _same_opt(opt3.state_dict(), opt_sd, "load_merged_state_dict optimizer")
    # the reference single-device optimizer state dict (no param_names) matches by position
    pm4, opt4 = _fresh(rank, world, plan)
    load_merged_state_dict(pm4, {**ref.state_dict(), "freq": ref.freq}, opt4, ref_opt.state_dict())
    _same_opt(opt4.state_dict(), opt_sd, "load_merged_state_dict from the reference optimizer")
    for module, optim in [(pm, opt), (pm3, opt3)]:
        module(x[rows], t[rows]).backward()
        optim.step()
    _same_state(pm3.state_dict(), pm.state_dict(), "training after load_merged_state_dict")

    # deduped: only the first rank of each dp group keeps tensors; loading broadcasts the rest
    dd_model, dd_opt = deduped_state_dict(pm, opt)
    first = comm.rank_in_group(dp) == 0
    assert (set(dd_model) == {"_extra_state"}) != first, sorted(dd_model)
    assert bool(dd_opt["state"]) == first
    pm5, opt5 = _fresh(rank, world, plan)
    load_deduped_state_dict(pm5, dd_model, opt5, dd_opt)
    _same_state(pm5.state_dict(), pm.state_dict(), "load_deduped_state_dict model")
    _same_opt(opt5.state_dict(), opt.state_dict(), "load_deduped_state_dict optimizer")

    pm6, opt6 = _fresh(rank, world, plan)
    load_sharded_state_dict(pm6, pm.state_dict(), opt6, opt.state_dict())
    pm6.load_merged_state_dict({"freq": ref.freq}, strict=False)  # in no state dict; broadcast needs it
    _same_opt(opt6.state_dict(), opt.state_dict(), "load_sharded_state_dict optimizer")
    if not first:
        with torch.no_grad():
            pm6.scale.add_(1.0)
    broadcast_weights(pm6)
    _same_state(pm6.state_dict(), pm.state_dict(), "broadcast_weights")

    out: dict[str, Any] = {"sd": sd, "opt": opt_sd}
    if rank == 0:
        out["ref"], out["ref_opt"] = _cpu(ref.state_dict()), ref_opt.state_dict()
    return out


@pytest.mark.timeout(120)
def test_tp2_dp2_matches_single_device() -> None:
    res = run_dist(train_worker, 4, timeout=110)
    ref, ref_opt = res[0]["ref"], res[0]["ref_opt"]
    assert "head.weight" in ref and "fc2.weight" in ref
    order = [3, 1, 0, 2]
    random.Random(0).shuffle(order)
    for ranks in [order, [2, 3], [1, 0]]:  # all ranks (duplicated replicas), or one replica
        merged, merged_opt = merge_state_dicts([res[r]["sd"] for r in ranks], [res[r]["opt"] for r in ranks])
        _same_state(merged, ref, f"merged model from ranks {ranks}")
        assert merged_opt is not None
        _same_opt(merged_opt, ref_opt, f"merged optimizer from ranks {ranks}")
        assert merged_opt["param_groups"][0]["param_names"] == [n for n, _ in Ref().named_parameters()]
    with pytest.raises(ValueError, match="missing pieces"):
        merge_state_dicts([res[0]["sd"], res[2]["sd"]])


class Wrapper(nn.Module):
    """A user model with a parallelized sub-module and a parameter outside it."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.body = body

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.body(torch.tanh(self.pre(x)), t)


def _train_alone(model: nn.Module, ref: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.optim.Optimizer:
    opt = build_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for step in range(2):
        loss, ref_loss = model(x, t), ref(x, t)
        loss.backward()
        ref_loss.backward()
        _close(loss, ref_loss, f"loss at step {step}")
        if step == 1:
            ref_norm = float(nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
            _close(float(opt.clip_gnorm(0.05)), ref_norm, "clip_gnorm")  # type: ignore[attr-defined]
        for o in [opt, ref_opt]:
            o.step()
            o.zero_grad()
    merged, merged_opt = merge_state_dicts([model.state_dict()], [opt.state_dict()])
    _same_state(merged, ref.state_dict(), "merged model")
    assert merged_opt is not None
    _same_opt(merged_opt, ref_opt.state_dict(), "merged optimizer")
    return opt


def test_single_process_without_process_group() -> None:
    assert not dist.is_initialized()
    ref, full, x, t = _setup()
    pm = Gen(0, 1, 1, init_params=False)
    assert pm.group("tp") is None and pm.group("dp") is None and pm.group("plan") is None
    pm.load_merged_state_dict(full)
    assert pm.dist_param_map["fc1_weight"] == "fc1.weight"
    _train_alone(pm, ref, x, t)

    ref, full, x, t = _setup()
    wrapped_ref = Wrapper(ref)
    model = Wrapper(Gen(0, 1, 1, init_params=False))
    load_merged_state_dict(model, {**wrapped_ref.state_dict(), "body.freq": ref.freq})
    _train_alone(model, wrapped_ref, x, t)


def test_initial_weights_from_class_attribute_or_file(tmp_path: Any) -> None:
    _, full, _, _ = _setup()

    class FromDict(Gen):
        init_state_dict = full

    pm = FromDict(0, 1, 1)
    _same_state(
        {k: v for k, v in pm.state_dict().items() if k != "_extra_state"},
        {k: v for k, v in full.items() if k not in ("freq", "head.weight")},
        "init from init_state_dict",
    )
    _close(pm.freq, full["freq"], "non-persistent buffer")

    torch.save(full, tmp_path / "full.pt")

    class FromFile(Gen):
        init_weights_file = str(tmp_path / "full.pt")

    pm = FromFile(1, 2, 2)  # rank 1 of a 2-way plan, built without a process group (it cannot run)
    with pytest.raises(RuntimeError, match="rank 1 of a plan for 2 devices.*not initialised"):
        pm(torch.zeros(2, D), torch.zeros(2, D))
    # rank 1 holds shard index 0
    _close(pm.fc1_weight, torch.cat([full["fc1.weight"][i : i + 3] for i in (0, 6, 12)]), "strided shard")
    _close(pm.fc2_weight, full["fc2.weight"][:, :3], "column shard")

    class Missing(Gen):
        init_state_dict = {k: v for k, v in full.items() if k != "freq"}

    with pytest.raises(KeyError, match="freq"):
        Missing(0, 1, 1)


def test_registration_and_strict_loading_errors() -> None:
    _, full, _, _ = _setup()
    pm = Gen(0, 1, 1, init_params=False)
    with pytest.raises(ValueError, match="twice"):
        pm.add_shard("scale", "scale", (D,), torch.float32)
    with pytest.raises(KeyError, match="add_shard first"):
        pm.add_alias("other", "nope.weight")
    with pytest.raises(RuntimeError, match=r"missing keys \['scale'\].*unexpected keys \['extra'\]"):
        pm.load_merged_state_dict(
            {**{k: v for k, v in full.items() if k != "scale"}, "extra": torch.zeros(1)}
        )
    only_alias = {k: v for k, v in full.items() if k != "fc2.weight"}  # the tied name alone is enough
    assert pm.load_merged_state_dict(only_alias) == ([], [])
    with pytest.raises(ValueError, match="full shape"):
        pm.load_merged_state_dict({**full, "scale": torch.zeros(D + 1)})
    with pytest.raises(RuntimeError, match="size mismatch"):
        pm.load_state_dict({**pm.state_dict(), "scale": torch.zeros(D + 1)})


def teardown_worker(rank: int, world: int) -> dict[str, Any]:
    import atexit

    import nnscaler
    from nnscaler.runtime.dist import lifecycle

    nnscaler.init()  # the group is up already; init still arranges the teardown at exit
    ref, full, x, t = _setup()
    pm = Gen(rank, world, 1, init_params=False)
    pm.compute_config = ComputeConfig(1, world)
    pm.load_merged_state_dict(full)
    pm(x[rank::world], t[rank::world]).backward()
    had = pm._reducer is not None and all(p.grad is not None for p in pm.parameters())
    nnscaler.uninit()
    return {
        "had_reducer_and_grads": had,
        "reducer_after": pm._reducer is not None,
        "grads_after": any(p.grad is not None for p in pm.parameters()),
        "group_after": dist.is_initialized(),
        "registered": lifecycle._REGISTERED[0] and atexit.unregister is not None,
    }


def test_uninit_releases_buckets_before_the_group() -> None:
    """Buckets that async collectives wrote into, alive while the interpreter shuts down, made gloo
    abort at exit now and then; uninit (also run at exit) drops them first."""
    for r in run_dist(teardown_worker, 2):
        assert r == {
            "had_reducer_and_grads": True,
            "reducer_after": False,
            "grads_after": False,
            "group_after": False,
            "registered": True,
        }, r
