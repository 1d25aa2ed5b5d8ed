"""Headless output: the run's meaningful events as one line each on stderr (`specpilot run --headless`)."""

from __future__ import annotations

import sys

from specpilot.core import events as ev
from specpilot.core import progress


def line_for(body: ev.EventBody) -> str | None:
    """The line a headless run prints for one event, or None for events it keeps quiet about."""
    match body:
        case ev.RoundStarted():
            return f"round {body.round}"
        case ev.Gaps():
            return (f"  measured {body.measured_tokens_per_s:.0f} tok/s, ceiling {body.ceiling_tokens_per_s:.0f}; "
                    f"largest gap: {body.largest_gap}")
        case ev.CandidateProposed():
            return f"  {body.cid} {body.agent}: {body.title}"
        case ev.CandidateFailed():
            return f"  {body.cid} {body.agent}: no candidate ({body.reason})"
        case ev.GateChecked(passed=False):
            return f"    {body.cid} failed {body.gate}: {body.detail}"
        case ev.Evaluated():
            return (f"    {body.cid} {body.split}: {body.speedup:.3f}x [{body.low:.3f}, {body.high:.3f}] "
                    "vs the incumbent")
        case ev.NewIncumbent():
            return (f"  incumbent: {body.heldout_speedup_vs_ar:.2f}x vs AR, {body.heldout_speedup_vs_stock:.2f}x "
                    f"vs stock (held-out)")
        case ev.Notice():
            return f"  notice: {body.message}"
        case ev.Progress() if _progress_worth_a_line(body):
            return f"  {progress.describe(body.to_payload())}"
        case ev.RunFinished():
            reason = body.summary.get("reason") if isinstance(body.summary, dict) else None
            return f"run {body.run} {body.status}" + (f": {reason}" if reason else "")
    return None


def stderr_progress(event: ev.Event) -> None:
    """Headless progress: one line per meaningful event on stderr (an event that does not parse is skipped)."""
    try:
        line = line_for(event.body)
    except ev.MalformedEvent:
        return
    if line:
        print(line, file=sys.stderr, flush=True)


_printed: dict[str, int] = {}


def _progress_worth_a_line(p: ev.Progress) -> bool:
    """Headless output keeps a long step to a few lines: its start, each quarter, its end."""
    if not p.total:
        return False
    quarter = 4 * p.done // p.total
    if _printed.get(p.step) == quarter:
        return False
    _printed[p.step] = quarter
    return True
