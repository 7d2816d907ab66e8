"""The plan picture without a browser: the schedule's op order against torch.distributed.pipelining's
own, its timing against the schedules' closed forms, the drawn element counts, `whalepy diff`, the CLI."""

from __future__ import annotations

import re
from types import SimpleNamespace
from xml.etree import ElementTree

import pytest

from show_cases import homogeneous_3d, interleaved, mixed, uniform_plan
from whalepy.errors import PlanError
from whalepy.tools.show import plan_diff, plan_html, plan_timeline_svg
from whalepy.tools.show.schedule import OpKind, gpipe_order, interleaved_order, one_f_one_b_order, simulate
from whalepy.tools.cli import main
from whalepy.ir.plan import Schedule

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_ops(actions) -> list[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    """torch's actions without idle slots and gradient reductions, as (kind, stage, micro-batch)."""
    kinds = {"F": "forward", "B": "backward"}
    return [(kinds[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in actions if a is not None and a.computation_type.value in kinds]


def _ours(ops) -> list[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    return [(o.kind.value, o.stage, o.microbatch) for o in ops]


class _RecordingStage:
    """Stands in for a pipeline stage: records forward_one_chunk / backward_one_chunk calls; no p2p."""

    def __init__(self, stage_index: int) -> None:
        self.stage_index = stage_index
        self.ops: list[tuple[str, int, int]] = []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name.startswith("get_") and name.endswith("_ops"):
            return lambda *a, **k: []
        return lambda *a, **k: None

    def forward_one_chunk(self, mb: int, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.ops.append(("forward", self.stage_index, mb))

    def backward_one_chunk(self, mb: int, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.ops.append(("backward", self.stage_index, mb))


def _run_torch_schedule(cls, num_stages: int, num_microbatches: int,  # type: ignore[no-untyped-def]
                        stage: int) -> list[tuple[str, int, int]]:
    """What torch's ScheduleGPipe / Schedule1F1B._step_microbatches executes on one stage."""
    sched = object.__new__(cls)
    rec = _RecordingStage(stage)
    sched.__dict__.update(_stage=rec, _n_microbatches=num_microbatches, _num_stages=num_stages, scale_grads=True,
                          _has_backward=True)
    sched._check_inputs = lambda args, kwargs, targets, losses: (args, kwargs)
    for name in ("_initialize_stage", "_maybe_compute_loss", "_maybe_get_loss", "_update_losses"):
        setattr(sched, name, lambda *a, **k: None)
    sched._step_microbatches(arg_mbs=[()] * num_microbatches, kwarg_mbs=[{}] * num_microbatches)
    return rec.ops


@pytest.mark.parametrize("S", [1, 2, 3, 4, 8])
def test_gpipe_and_1f1b_order_match_torch(S: int) -> None:
    # torch's own step code run against a recording stage (its _get_pipeline_order IR differs from what
    # Schedule1F1B runs on the last stage, so the executed order is the reference)
    for M in range(1, 2 * S + 3):
        for r in range(S):
            assert _ours(gpipe_order(r, S, M)) == _run_torch_schedule(schedules.ScheduleGPipe, S, M, r)
            assert _ours(one_f_one_b_order(r, S, M)) == _run_torch_schedule(schedules.Schedule1F1B, S, M, r), (S, M, r)


@pytest.mark.parametrize("S,v", [(2, 2), (3, 2), (4, 2), (4, 3), (8, 2)])
def test_interleaved_order_matches_torch(S: int, v: int) -> None:
    for M in range(1, 3 * S + 1):
        rounds = max(1, M // S)
        if M % rounds:
            with pytest.raises(PlanError, match="multiple of the"):
                interleaved_order(0, S, M, v)
            continue
        ns = SimpleNamespace(n_local_stages=v, pp_group_size=S, _n_microbatches=M, microbatches_per_round=M // rounds)
        for r in range(S):
            theirs = schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, r)
            assert _ours(interleaved_order(r, S, M, v)) == _torch_ops(theirs), (S, v, M, r)


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_timeline_matches_closed_form(schedule: Schedule) -> None:
    # GPipe and 1F1B with equal stages and free sends: (M + S - 1) (t_f + t_b) (Huang et al. 2019;
    # Narayanan et al. 2021, section 2.2.1)
    for S, M in ((1, 3), (4, 4), (4, 8), (3, 7)):
        tl = simulate(uniform_plan(stages=S, microbatches=M, schedule=schedule))
        assert tl.makespan_s == pytest.approx((M + S - 1) * 3.0)
        for r in range(S):
            assert tl.busy_s(r) == pytest.approx(M * 3.0)
            assert tl.bubble_s(r) == pytest.approx((S - 1) * 3.0)


def test_interleaved_timeline_matches_closed_form() -> None:
    # Narayanan et al. 2021, section 2.2.2: with v chunks per rank and M a multiple of S the bubble
    # shrinks to (S - 1) chunk times: makespan = (v M + S - 1) (t_f + t_b) per chunk
    for S, v, M in ((4, 2, 8), (4, 2, 4), (2, 3, 4)):
        tl = simulate(uniform_plan(stages=S, microbatches=M, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=v))
        assert tl.makespan_s == pytest.approx((v * M + S - 1) * 3.0), (S, v, M)


def test_timeline_respects_dependencies_and_sends() -> None:
    plan = uniform_plan(stages=3, microbatches=4, schedule=Schedule.ONE_F_ONE_B, p2p_s=0.5)
    tl = simulate(plan)
    end = {(o.kind, o.stage, o.microbatch): o for o in tl.ops if o.kind in (OpKind.FORWARD, OpKind.BACKWARD)}
    sends = [0.5, 0.25, 0.5]  # p2p_s per micro-batch over each stage's sends: 1, 2 (middle) and 1
    for (kind, j, m), o in end.items():
        if kind is OpKind.FORWARD and j > 0:
            assert o.start_s >= end[(kind, j - 1, m)].end_s + sends[j - 1] - 1e-12
        if kind is OpKind.BACKWARD and j < 2:
            assert o.start_s >= end[(kind, j + 1, m)].end_s + sends[j + 1] - 1e-12
    assert sum(o.kind is OpKind.SEND for o in tl.ops) == 4 * 4  # 2 sends per micro-batch per boundary
    for r in range(3):
        ops = sorted((o for o in tl.of_rank(r) if o.kind is not OpKind.SEND), key=lambda o: o.start_s)
        for a, b in zip(ops, ops[1:]):
            assert b.start_s >= a.end_s - 1e-12, "ops on one rank overlap"
        assert sum(o.end_s - o.start_s for o in ops) == pytest.approx(tl.makespan_s)


def _count(html: str, pattern: str) -> int:
    return len(re.findall(pattern, html))


@pytest.mark.parametrize("make", [homogeneous_3d, interleaved, mixed])
def test_page_draws_every_device_stage_and_microbatch(make) -> None:  # type: ignore[no-untyped-def]
    plan = make()
    html = plan_html(plan)
    assert _count(html, r'<rect class="wp-device"') == plan.world_size
    assert _count(html, r'<tr class="wp-stage"') == plan.pp_degree
    assert _count(html, r'<g class="wp-mem" ') == plan.pp_degree
    assert _count(html, r'class="wp-share"') == plan.dp_degree
    per_rank = plan.num_microbatches * plan.virtual_stages
    for r in range(plan.pp_degree):
        for kind in ("forward", "backward"):
            assert _count(html, rf'data-kind="{kind}" data-rank="{r}" ') == per_rank
    assert not re.search(r'(src|href)="(https?:)?//', html), "the page must not fetch anything"
    svg = plan_timeline_svg(plan)
    root = ElementTree.fromstring(svg)  # a standalone .svg must be well-formed XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert _count(svg, r'data-kind="forward"') == plan.pp_degree * per_rank


def test_diff_names_the_changes_and_the_effect() -> None:
    a, b = homogeneous_3d(), interleaved()
    text = plan_diff(a, b)
    assert "degrees: pp=4 dp=4 tp=4/4/4/4 -> pp=4 dp=8 tp=2/2/2/2" in text
    assert "schedule: 1f1b -> interleaved_1f1b v=2" in text
    assert "blocks moved:" in text
    pct = 100 * (b.cost.step_time_s / a.cost.step_time_s - 1)
    assert f"({pct:+.1f}%)" in text
    same = plan_diff(a, a)
    assert "no differences in the parallel layout" in same and "(+0.0%)" in same


def test_diff_and_page_name_offload_tiling_and_reduction_changes() -> None:
    import dataclasses

    from whalepy.runtime import make_plan

    names = ["embed", "h.0", "h.1", "head"]
    a = make_plan(names, dp=2, global_batch=8, zero_stage=3, num_microbatches=2)
    st = a.stages[0]
    blocks = tuple(dataclasses.replace(blk, tiles=2 if blk.name.startswith("h.") else 1,
                                       activation_offload=blk.name == "h.1", checkpoint=blk.name == "h.0",
                                       checkpoint_offload=blk.name == "h.0") for blk in st.blocks)
    b = dataclasses.replace(a, stages=(dataclasses.replace(st, blocks=blocks, reduce_every_microbatch=True),))
    text = plan_diff(a, b)
    assert "memory-centric tiling:\n    h.0-1: tiles 1 -> 2" in text, text
    assert "activation offload:\n    h.0: checkpointed input in host memory added\n" \
           "    h.1: activations in host memory added" in text, text
    assert "stage 0: gradients reduced every micro-batch" in text, text
    page = plan_html(b)
    assert "tiles 2" in page and "gradients reduced every micro-batch" in page
    assert "activations in host memory" in page and "checkpoints in host memory" in page


def test_cli_show_html_svg_and_diff(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    homogeneous_3d().save(a)
    interleaved().save(b)
    assert main(["show", str(a), "--html", str(tmp_path / "p.html"), "--svg", str(tmp_path / "t.svg")]) == 0
    assert (tmp_path / "p.html").read_text().startswith("<!DOCTYPE html>")
    assert (tmp_path / "t.svg").read_text().startswith("<svg")
    assert main(["diff", str(a), str(b)]) == 0
    assert "predicted effect:" in capsys.readouterr().out
    assert main(["show", str(a), "--html", str(tmp_path / "missing" / "p.html")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_api_refuses_a_non_plan() -> None:
    with pytest.raises(PlanError, match="expected a whalepy.Plan"):
        plan_html("plan.json")  # type: ignore[arg-type]


def test_plan_without_chunk_times_is_drawn_with_a_stated_split() -> None:
    import dataclasses

    base = uniform_plan(stages=2, microbatches=2, schedule=Schedule.GPIPE)
    old = dataclasses.replace(base, stages=tuple(
        dataclasses.replace(s, cost=dataclasses.replace(s.cost, chunk_forward_s=(), chunk_backward_s=()))
        for s in base.stages))
    tl = simulate(old)
    fwd = [o.end_s - o.start_s for o in tl.ops if o.kind is OpKind.FORWARD]
    assert fwd == pytest.approx([3.0 / 3] * 4)  # compute_s 3 s split 1 : 2 (BACKWARD_PER_FORWARD)
    assert tl.notes and "1 : 2" in tl.notes[0]
    assert "1 : 2 between forward and backward" in plan_html(old)


@pytest.mark.parametrize("make", [homogeneous_3d, interleaved, mixed])
def test_chunk_times_add_up_to_the_stage_busy_time(make) -> None:  # type: ignore[no-untyped-def]
    # chunk_forward_s / chunk_backward_s (build.py, per chunk) against compute + TP + exposed DP per
    # micro-batch (evaluate_stage, per stage): two paths through the cost model that must agree
    plan = make()
    for st in plan.stages:
        c = st.cost
        assert len(c.chunk_forward_s) == len(c.chunk_backward_s) == plan.virtual_stages
        assert all(f > 0 and b > f for f, b in zip(c.chunk_forward_s, c.chunk_backward_s))
        busy = sum(c.chunk_forward_s) + sum(c.chunk_backward_s)
        assert busy == pytest.approx(c.compute_s + c.comm_s - c.p2p_s + c.dp_comm_s, rel=1e-9)


def test_palettes_are_disjoint() -> None:
    """A colour means one thing on the page: stages, GPU types, forward, backward, the timeline's other
    kinds and the memory parts share none (issue 27: stage colours were forward / backward colours)."""
    from whalepy.tools.show.svg import PALETTES

    seen: dict[str, str] = {}
    for name, palette in PALETTES.items():
        for c in palette:
            assert seen.setdefault(c.lower(), name) == name, (c, seen[c.lower()], name)


def test_long_schedule_is_compressed_around_its_steady_state() -> None:
    """128 micro-batches of 1F1B on 4 stages: too dense for the page's width, so the steady state is cut
    out; the warm-up (the first rank's forwards before its first backward) and cool-down stay, every
    compute op is drawn or counted in the gap exactly once per rank, and the whole schedule is offered
    wide enough to read."""
    from whalepy.ir.plan import Schedule
    from whalepy.tools.show.page import plan_html
    from whalepy.tools.show.schedule import OpKind, simulate
    from whalepy.tools.show.timeline import PLOT_W, READABLE_OP_PX, full_width, steady_cut, timeline_svg

    from show_cases import uniform_plan

    plan = uniform_plan(stages=4, microbatches=128, schedule=Schedule.ONE_F_ONE_B)
    tl = simulate(plan)
    cut = steady_cut(plan, tl)
    assert cut is not None and 0.25 * tl.makespan_s <= cut.end_s - cut.start_s < tl.makespan_s
    first = [o for o in tl.of_rank(0) if o.kind in (OpKind.FORWARD, OpKind.BACKWARD)]
    assert all(o.end_s <= cut.start_s for o in first[:4])  # rank 0's warm-up: 4 forwards
    assert all(o.start_s >= cut.end_s for o in first[-4:])  # and its cool-down: 4 backwards
    svg = timeline_svg(plan, tl, compress=True)
    for r in range(4):
        ops = [o for o in tl.of_rank(r) if o.kind in (OpKind.FORWARD, OpKind.BACKWARD)]
        hidden = sum(1 for o in ops if o.start_s >= cut.start_s and o.end_s <= cut.end_s)
        assert f'class="wp-cut" data-rank="{r}" data-hidden="{hidden}"' in svg
        drawn = {(o.kind, o.microbatch) for o in ops if not (o.start_s >= cut.start_s and o.end_s <= cut.end_s)}
        assert 0 < len(drawn) and len(drawn) + hidden == 2 * 128
    wide = full_width(plan, tl)
    assert wide > PLOT_W and min(o.end_s - o.start_s for o in tl.ops if o.kind is OpKind.FORWARD) * wide / \
        tl.makespan_s >= READABLE_OP_PX
    page = plan_html(plan)
    assert page.count('class="wp-op"') == sum(1 for o in tl.ops) and "wp-whole" in page
    short = uniform_plan(stages=4, microbatches=8, schedule=Schedule.ONE_F_ONE_B)
    assert steady_cut(short, simulate(short)) is None  # 8 micro-batches read whole


def test_a_thousand_gpus_are_grouped_by_stage() -> None:
    """Above 128 ranks the devices are drawn per stage, one column per replica, labelled: every rank
    once, in its stage's group, its replica and shard on the cell (for the hover text)."""
    import re

    from show_cases import at_scale
    from whalepy.tools.show.panels import devices_grid

    plan = at_scale()
    svg = devices_grid(plan)
    assert "wp-grouped" in svg and svg.count('class="wp-stage-group"') == plan.pp_degree
    cells = re.findall(r'class="wp-device" [^>]*data-rank="(\d+)" data-stage="(\d+)" data-replica="(\d+)" '
                       r'data-tp="(\d+)"', svg)
    assert sorted(int(c[0]) for c in cells) == list(range(1024))
    for r, s, d, t in cells:
        assert plan.stages[int(s)].ranks[int(d)][int(t)] == int(r)
    assert all(f"stage {st.index} · " in svg for st in plan.stages)
