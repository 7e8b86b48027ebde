"""Why the search did not take a standard recipe that the cost model predicts faster than its plan:
the recipe's recorded exclusions (memory, user constraints), what offline planning did not search, or
an honest "no recorded reason"."""

from __future__ import annotations

from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.context import PlannerSetup
from nnscaler.policies.autodist.recipes import Recipe

__all__ = ["why_not_taken"]


def why_not_taken(r: Recipe, setup: PlannerSetup, scored: list[Candidate] | None = None) -> list[str]:
    """Every reason recorded against recipe `r` under `setup` (`scored`: what the search scored)."""
    c = r.candidate
    out = list(r.excluded)
    if scored and setup.global_batch:  # offline planning searched plan sizes and ZeRO stages
        size = c.pp * c.tp * c.ep
        if size not in {x.pp * x.tp * x.cp_size * x.ep for x in scored}:
            out.append(
                f"the search kept no plan over {size} device(s) (a fixed --plan-ngpus, or none fitted)"
            )
        zeros = {x.zero for x in scored}
        if r.dp > 1 and r.zero not in zeros:
            why = (
                "ZeRO-2 costs the same and keeps less" if r.zero == 1 else "pas_config['zero_stage'] fixes it"
            )
            out.append(f"ZeRO-{r.zero} is not searched ({why})")
    if out:
        return out
    if setup.constraints and c.tp > 1:
        return [
            "not considered by the search: partition constraints turn off its Megatron-layout alternative"
        ]
    same = [x for x in scored or [] if (x.pp, x.tp, x.cp_size, x.ep) == (c.pp, c.tp, 1, c.ep)]
    if same:
        best = min(same, key=lambda x: x.step_time)
        return [
            f"not considered by the search: no constraint or memory limit excludes it; the search's own "
            f"partition of pp={c.pp}{f' ep={c.ep}' if c.ep > 1 else ''} tp={c.tp} was scored {best.step_time * 1e3:.3f} ms per step "
            "and this recipe's layout is not among its choices"
        ]
    return [
        "not considered by the search: no recorded reason (no constraint or memory limit excludes it; "
        "the search's estimate of its own partitions missed this layout)"
    ]
