"""plan_report.md's pipeline-schedule section: the schedule taken, its predicted bubble, and every
schedule the search costed on the same configuration with why it was not taken (schedule_choice.py)."""

from __future__ import annotations

from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.plan import Plan

__all__ = ["schedule_report_lines"]


def _same_configuration(x: Candidate, cand: Candidate) -> bool:
    return (x.pp, x.tp, x.nmicros, x.recompute, x.cp_size, x.ep) == (
        cand.pp,
        cand.tp,
        cand.nmicros,
        cand.recompute,
        cand.cp_size,
        cand.ep,
    ) and (x.scheduler, len(x.starts)) == (cand.scheduler, len(cand.starts))


def schedule_report_lines(plan: Plan, cand: Candidate, scored: list[Candidate] | None) -> list[str]:
    """The section's lines (none without a pipeline)."""
    p = plan.pipeline
    if p is None:
        return []
    lines = [
        "",
        "## Pipeline schedule",
        "",
        f"Chosen: {p.scheduler}, {p.nstages} stages on {p.pp_size} device groups, {p.nmicros} micro-batches; "
        f"predicted bubble {cand.bubble_share:.1%} of the step.",
    ]
    match = next((x for x in scored or () if x.schedule_options and _same_configuration(x, cand)), None)
    if match is None:
        return lines + ["", "No other schedule was costed for this configuration (pinned, or a given plan)."]
    lines += [
        "",
        "Every schedule the search costed on this configuration (the searched partition of its stages):",
        "",
        "| schedule | stages | step (ms) | bubble | memory (GB) | why not taken |",
        "|---|---|---|---|---|---|",
    ]
    for o in match.schedule_options:
        chosen = o.scheduler == p.scheduler and o.nstages == p.nstages
        name = f"**{o.scheduler}**" if chosen else o.scheduler
        if o.step == 0.0 and not o.fits:
            lines.append(f"| {name} | {o.nstages} | - | - | - | {o.why_not} |")
            continue
        lines.append(
            f"| {name} | {o.nstages} | {o.step * 1e3:.3f} | {o.bubble_share:.1%} | {o.memory / 1e9:.3f} | "
            f"{'' if chosen else o.why_not} |"
        )
    return lines
