"""Capacity frontier of the memory tiers (issue 10 acceptance): every published success of ZeRO-Offload,
ZeRO-Infinity and PatrickStar is planned feasible, every published or implied failure infeasible
(``benchmarks/validate_offload.py``, the table in docs/cost_model.md). A success whose mode the runtime
does not lower yet must say so (``PENDING`` with the capability's own refusal), never pass silently."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import validate_offload as vo  # noqa: E402

from whalepy.ir.rules import state_option_error  # noqa: E402
from whalepy.ir.plan_text import format_seconds as _t  # noqa: E402


KNOWN_GAPS: dict[str, str] = {}
"""Published successes the planner calls infeasible, and why (none today). ZeRO-Infinity's 32T on 512
V100 (620 layers of hidden 65536, one sample per GPU) was one until the embedding became tileable: its
checkpointed inputs go to host memory (``BlockPlan.checkpoint_offload``, ZeRO-Infinity sec. 5.1.2) and,
with the 3.3B-parameter token embedding tiled like the layers' linears (sec. 5.1.3), the FSDP2 working
set no longer fills the device. A row listed here must fail on GPU memory; when it holds, the list must
shrink (docs/cost_model.md shows such a row as WRONG)."""


def test_capacity_frontier_holds() -> None:
    rows = [vo.run_case(c) for c in vo.CASES]
    table = vo.table(rows)
    for r in rows:
        if r.case.claim in KNOWN_GAPS:
            assert r.case.fits and not r.holds and r.binding == "GPU memory", (
                f"{r.case.claim} now holds: drop it from KNOWN_GAPS\n{table}")
        elif r.pending:
            # only a published success may wait for a runtime mode, and only because the capability
            # refuses parameters on NVMe (ZeRO-Infinity): once helper offinf opens them the row must hold
            assert r.case.fits and not r.planned, table
            assert r.pending == state_option_error(3, "nvme", "nvme"), table
        else:
            assert r.holds, f"frontier broken for {r.case.claim}:\n{table}"
            assert (r.margin >= 0) == r.case.fits, table  # a margin that agrees with the verdict
    # the table covers successes and failures of all three systems
    assert {r.case.system for r in rows if not r.pending and r.case.fits} >= {"ZeRO-Offload", "PatrickStar"}
    assert {r.case.system for r in rows if not r.case.fits} == {"ZeRO-Offload", "ZeRO-Infinity", "PatrickStar"}


def test_plan_dump_shows_tiers_depth_and_exposed_offload() -> None:
    """ZeRO-Offload's published 13B on one V100: the plan keeps states on the host and its dump names
    each block's tiers, the prefetch depth of host-resident parameters and the exposed offload time."""
    plan = vo._plan(vo.CASES[0])
    text = str(plan)
    st = next(s for s in plan.stages if any(b.param_tier.value != "gpu" for b in s.blocks))
    assert st.cost.offload_s > 0 and st.cost.host_state_bytes > 0
    assert "offload (tiers " in text and "cpu/cpu prefetch 1" in text, text
    assert f"exposed {_t(st.cost.offload_s)} per step" in text, text
    assert "fetched 1 block ahead" in text, text

