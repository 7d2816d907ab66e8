"""Pictures of a plan: ``whalepy show plan.json --html plan.html`` (one self-contained page), ``--svg``
(the pipeline timeline alone) and ``whalepy diff a.json b.json``. See docs/show.md.

- :mod:`.schedule`: the op order per pipeline rank (as torch.distributed.pipelining runs it) and its
  timing from the plan's predicted per-stage times;
- :mod:`.timeline`: that timeline as SVG; :mod:`.panels`: devices grid, memory bars, GPU types,
  alternatives; :mod:`.page`: the HTML page; :mod:`.diff`: the text diff of two plans.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from whalepy.ir.plan import Plan


def plan_html(plan: Plan) -> str:
    """The plan as one self-contained HTML page (inline CSS, SVG and JavaScript; nothing fetched)."""
    from whalepy.tools.show.page import plan_html as render

    return render(_check(plan))


def plan_timeline_svg(plan: Plan) -> str:
    """The plan's pipeline schedule (forward, backward, sends, gradient sync, bubbles per rank) as SVG."""
    from whalepy.tools.show.timeline import timeline_svg

    return timeline_svg(_check(plan))


def plan_diff(a: Plan, b: Plan) -> str:
    """What changed from plan ``a`` to plan ``b`` and the predicted effect on step time and memory."""
    from whalepy.tools.show.diff import plan_diff as render

    return render(_check(a), _check(b))


def write_text(path: str | Path, text: str, *, inputs: tuple[str | Path, ...] = (), what: str = "output") -> None:
    """Write a page or picture atomically, with a one-line error if the place cannot be written or is
    one of ``inputs`` (the plan the page shows)."""
    from whalepy.files import write_file

    write_file(path, text, inputs=inputs, what=what)


def _check(plan: object) -> Plan:
    from whalepy.errors import PlanError
    from whalepy.ir.plan import Plan

    if not isinstance(plan, Plan):
        raise PlanError(f"expected a whalepy.Plan, got {type(plan).__name__}; load one with whalepy.Plan.load(path)")
    return plan


__all__ = ["plan_diff", "plan_html", "plan_timeline_svg", "write_text"]
