"""A plan for the new device count after an elastic restart: same policy, same global batch.

The plan size (compute_config.plan_ngpus) is kept when it divides the new world size, otherwise the
divisor of the new world nearest to it (the smaller one on a tie) is taken. The global batch stays the
same, so the data-parallel replicas change and gradient accumulation makes up the difference; the
samplers split the same sample order over the new replicas, so each step sees the same samples.
"""

from __future__ import annotations

from typing import Any

from nnscaler.errors import ConfigError

__all__ = ["nearest_plan_size", "replan"]


def nearest_plan_size(world: int, plan_ngpus: int) -> int:
    """`plan_ngpus` if it divides `world`, else the nearest divisor of `world` (smaller on a tie)."""
    if world % plan_ngpus == 0:
        return plan_ngpus
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return min(divisors, key=lambda d: (abs(d - plan_ngpus), d))


def replan(args: Any, world: int) -> tuple[Any, str | None]:
    """TrainerArgs for `world` ranks (the same object when nothing changes) and a line saying what changed."""
    cc = args.compute_config
    if world == cc.runtime_ngpus:
        return args, None
    plan = nearest_plan_size(world, cc.plan_ngpus)
    data = args.to_dict()
    data["compute_config"] = {**data["compute_config"], "runtime_ngpus": world, "plan_ngpus": plan}
    data["grad_accumulation_steps"] = None  # derived again from the unchanged global_batch_size
    if data.get("gen_reuse") == "match":  # the code generated for the old world does not match: redo it
        data["gen_reuse"] = "moo"
    try:
        new = type(args).from_dict(data)
    except ConfigError as err:
        raise ConfigError(
            f"elastic restart on {world} ranks: the config does not fit plan_ngpus {plan} x {world // plan} "
            f"data-parallel replicas: {err}"
        ) from err
    kept = "kept" if plan == cc.plan_ngpus else f"changed from {cc.plan_ngpus} (it does not divide {world})"
    line = (
        f"new plan for {world} ranks: {args.pas_policy} plan_ngpus {plan} ({kept}), data-parallel replicas "
        f"{args.scaling_factor} -> {new.scaling_factor}, grad_accumulation_steps {args.update_freq} -> "
        f"{new.update_freq} (global batch {new.global_batch_size})"
    )
    return new, line
