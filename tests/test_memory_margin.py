"""The memory margin (issue 27): ``PlannerOptions.memory_margin`` takes device memory out of every
feasibility check of the planner and of ``estimate``, is shown per stage, and is refused with one line
when malformed (before any capture on the command line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from whalepy.errors import InfeasibleError, PlanError
from whalepy.planner import PlannerOptions, plan_from_profile
from whalepy.planner.margin import DEFAULT_MEMORY_MARGIN, MemoryMargin, parse_memory_margin
from whalepy.planner.estimate import ParallelConfig, estimate_from_profile
from whalepy.planner.synthetic import transformer_profile

from planner_fixtures import cluster, group, tiny_device

GIB = 2**30
CLUSTERS = Path(__file__).resolve().parents[1] / "examples" / "clusters"
PROF = transformer_profile(num_layers=4, hidden=1024, seq_len=512, vocab=8000, num_heads=8, batch=1,
                           name="margin")
DEVICE_GIB = 6.0


def _cluster():  # type: ignore[no-untyped-def]
    dev = tiny_device("a100-6g", "A100-80GB", DEVICE_GIB)
    return cluster(group("a", dev.name, 2, 1, link="pcie4", custom={dev.name: dev}, cpu_gb=None), custom=[dev])


def _plan(margin):  # type: ignore[no-untyped-def]
    return plan_from_profile(PROF, _cluster(), global_batch=16, max_microbatches=4, schedules=("1f1b",),
                             allow_offload=False, memory_margin=margin)


def test_forms_and_bad_values() -> None:
    assert PlannerOptions().memory_margin == MemoryMargin(fraction=DEFAULT_MEMORY_MARGIN)
    assert parse_memory_margin("5%") == parse_memory_margin(0.05) == MemoryMargin(fraction=0.05)
    assert parse_memory_margin(" 4 GiB ") == MemoryMargin(gib=4.0) and str(MemoryMargin(gib=4.0)) == "4 GiB"
    assert parse_memory_margin(0).bytes_for(80 * GIB) == 0
    assert MemoryMargin(fraction=0.05).bytes_for(80 * GIB) == 4 * GIB
    for bad in (1.0, -0.1, "120%", "x%", "4GB", "lots", True, None, float("nan")):
        with pytest.raises(PlanError, match="memory_margin"):
            PlannerOptions(memory_margin=bad)


def test_a_margin_moves_the_plan_off_the_limit_and_is_shown() -> None:
    """Plan with no margin, then with a margin just larger than that plan's headroom: the first plan no
    longer fits, so the planner picks another (or none); every stage keeps below the smaller usable
    memory, and usable + reserve + margin is the device's memory."""
    free = _plan(0)
    tight = min(s.cost.capacity_bytes - s.cost.memory_bytes for s in free.stages)
    assert tight >= 0 and all(s.cost.margin_bytes == 0 for s in free.stages)
    margin = (tight + 0.05 * GIB) / GIB
    try:
        kept = _plan(f"{margin}GiB")
    except InfeasibleError as e:
        assert "usable" in str(e)
        return
    assert kept.to_json() != free.to_json()
    for s in kept.stages:
        c = s.cost
        assert c.margin_bytes == pytest.approx(margin * GIB, abs=1)
        assert c.capacity_bytes + c.reserve_bytes + c.margin_bytes == pytest.approx(DEVICE_GIB * GIB, abs=2)
        assert c.memory_bytes <= c.capacity_bytes * (1 + 1e-6)
    assert f"margin {margin:.2f}" in str(kept)


def test_estimate_applies_the_margin() -> None:
    """The configuration the margin-free plan chose fits in ``estimate`` without a margin and not with
    one larger than its headroom; the default margin is charged when none is given."""
    free = _plan(0)
    cfg = ParallelConfig(dp=free.dp_degree, pp=free.pp_degree, tp=free.stages[0].tp_degree,
                         num_microbatches=free.num_microbatches, zero_stage=int(free.stages[0].zero_stage),
                         checkpoint=tuple(sum(b.checkpoint for b in s.blocks) for s in free.stages),
                         boundaries=tuple(len(s.blocks) for s in free.stages))
    est0 = estimate_from_profile(PROF, _cluster(), cfg, global_batch=16, memory_margin=0)
    assert est0.feasible and est0.step_time_s == pytest.approx(free.cost.step_time_s, rel=1e-9)
    tight = min(s.capacity_bytes - s.memory_bytes for s in est0.stages)
    over = estimate_from_profile(PROF, _cluster(), cfg, global_batch=16, memory_margin=f"{(tight + 0.05 * GIB) / GIB}GiB")
    assert not over.feasible and "usable" in over.reason
    default = estimate_from_profile(PROF, _cluster(), cfg, global_batch=16)
    assert default.stages[0].memory.margin == pytest.approx(DEFAULT_MEMORY_MARGIN * DEVICE_GIB * GIB)


def test_cli_refuses_a_bad_margin_before_the_capture(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import whalepy.tools.cli as cli

    monkeypatch.setattr(cli, "_profile", lambda *a, **k: pytest.fail("captured before checking --memory-margin"))
    for cmd in (["plan", "gpt2"], ["estimate", "gpt2", "--dp", "2"]):
        code = cli.main([*cmd, "--cluster", str(CLUSTERS / "cpu4.yaml"), "--global-batch", "8",
                         "--memory-margin", "lots"])
        assert code != 0
        err = capsys.readouterr().err
        assert "--memory-margin='lots' is not a memory margin" in err and err.count("\n") == 1, err
