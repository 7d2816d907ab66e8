"""Measured planning on the CPU device (whalepy.frontend.measure): profile(measure=True) -> plan -> a short
run of the plan on 2 gloo processes; the measured-costs format round-trips through a device-profile
file; an imported per-layer table drives a plan."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

import whalepy
from whalepy.errors import WhalepyError
from whalepy.ir.measured import MeasuredCosts, block_signature
from whalepy.ir.rules import tp_splits
from whalepy.tools.measured_files import import_layer_table, write_measured
from whalepy import ClusterSpec
from whalepy.planner import plan_from_profile
from whalepy.planner.costing import CostContext
from whalepy.planner.space import Hardware

from dist_harness import run_distributed
from measured_cases import build, reference_losses, run_plans


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """This process measures and trains with one intra-op thread, as every gloo rank here does
    (tests/dist_harness.py): on the shared 2-core CI machine under load, two OpenMP threads of this tiny
    model wait on each other at every kernel (a step of ``build()``'s GPT took 0.3-1 s instead of 3 ms),
    which was most of the ``measured`` fixture's time. What the tests check (every size and degree
    measured, the plan made from those numbers, the runs' losses) does not depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def measured():
    model, x, _ = build()
    return whalepy.profile(model, (x,), measure=True, micro_batches=(1, 2, 4), tp_degrees=(1, 2), repeats=1)


STEPS = 7
"""Steps each run trains: the plan check times steps 3-5, the closed loop times step 6 per block."""


@pytest.fixture(scope="module")
def runs(measured, tmp_path_factory):
    """Two plans trained on 2 gloo processes, one after the other in the same processes: the plan made
    from the measured profile (``plan_from_profile``, modelled nothing on the CPU) and a 2-stage
    pipeline estimated from a plain (modelled) profile, with what each run measured."""
    import os

    from whalepy.cost_models.device_profiles import forget_resolved_profiles
    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

    old = os.environ.get("WHALEPY_DEVICE_PROFILES")
    os.environ["WHALEPY_DEVICE_PROFILES"] = str(tmp_path_factory.mktemp("profiles"))  # no stray CPU profile
    forget_resolved_profiles()
    try:
        cluster = ClusterSpec.local(2)
        measured_plan = plan_from_profile(measured, cluster, global_batch=4, time_limit_s=20)
        plain = whalepy.profile(build()[0], (build()[1],))
        cfg = ParallelConfig(dp=1, pp=2, num_microbatches=2)
        before = estimate_from_profile(plain, cluster, cfg, global_batch=4)
        got = run_distributed(run_plans, 2, [measured_plan, before.plan], STEPS, timeout=300)
        yield {"measured_plan": measured_plan, "plain": plain, "cfg": cfg, "before": before,
               "ranks": got}
    finally:
        if old is None:
            os.environ.pop("WHALEPY_DEVICE_PROFILES", None)
        else:
            os.environ["WHALEPY_DEVICE_PROFILES"] = old
        forget_resolved_profiles()


def test_identical_blocks_share_one_measurement(measured):
    sigs = [block_signature(measured, b) for b in measured.blocks]
    layers = [s for s, b in zip(sigs, measured.blocks) if b.kind.value == "layer"]
    assert len(layers) == 3 and len(set(layers)) == 1
    m = measured.measured
    assert m.device_type == "CPU" and set(m.times) == set(sigs)
    for sig in set(sigs):
        for tp in (1, 2):
            for mb in (1.0, 2.0, 4.0):
                f, b = m.times[sig][("fp32", tp, mb)]
                assert f > 0 and b > 0
        assert m.updates[sig] > 0
    # the layer's saved activations are measured at each size and replace the estimate: the bytes per sample
    # of the line through the two largest sizes (what does not grow with the batch is charged apart)
    for sig in set(sigs):  # the warm-up trace and the per-size count agree at the largest size
        assert m.saved[sig][("fp32", False, 4.0)] == pytest.approx(m.activation_bytes[sig]["fp32"] * 4)
    fixed, per = m.saved_fit(layers[0], "fp32")
    assert per > 0 and fixed >= 0
    assert measured.blocks[1].activation_bytes == round(per * measured.batch_size)
    # a table written before the per-size counts (no ``saved``) still gives its per-sample bytes
    from dataclasses import replace

    from whalepy.frontend.measure import apply_measured_activations

    old = MeasuredCosts.from_dict({**m.to_dict(), "blocks": {s: {k: v for k, v in e.items() if k != "saved"}
                                                             for s, e in m.to_dict()["blocks"].items()}})
    assert not old.saved and old.activation_bytes == m.activation_bytes
    legacy = apply_measured_activations(replace(measured, measured=None), old, "fp32")
    assert legacy.blocks[1].activation_bytes == round(m.activation_bytes[layers[0]]["fp32"] * measured.batch_size)


def test_planner_uses_measured_times_and_says_so(measured, runs, tmp_path, monkeypatch):
    monkeypatch.setenv("WHALEPY_DEVICE_PROFILES", str(tmp_path))  # no stray calibrated CPU profile
    cluster = ClusterSpec.local(2)
    ctx = CostContext(measured, Hardware(cluster), precision="fp32")
    m = measured.measured
    for b in measured.blocks:
        sig = block_signature(measured, b)
        assert ctx.block_time(b.index, "CPU", 1, 2.0) == m.times[sig][("fp32", 1, 2.0)]
        # between measured sizes: linear
        lo, hi = m.times[sig][("fp32", 1, 2.0)], m.times[sig][("fp32", 1, 4.0)]
        assert ctx.block_time(b.index, "CPU", 1, 3.0) == pytest.approx(tuple((a + c) / 2 for a, c in zip(lo, hi)))
    plan = runs["measured_plan"]
    notes = [n for n in plan.notes if n.startswith("stage ")]
    assert len(notes) == len(plan.stages)
    assert all(f"measured for {len(s.blocks)} of {len(s.blocks)} blocks" in n and "optimizer step measured" in n
               for s, n in zip(plan.stages, notes))
    # the run of that plan on 2 gloo processes trains as one process does, and after its warm-up
    # steps the plan check (closed loop) times steps 3-5 against the plan
    ref = reference_losses(STEPS)
    for (losses, early, costs, seen, _), _ in runs["ranks"]:
        assert losses == pytest.approx(ref, rel=1e-4, abs=1e-5)
        assert seen.steps == 3 and seen.step_s > 0 and seen.predicted_step_s == plan.cost.step_time_s
        assert seen.peak_bytes is None
        # step 6, timed per block: blocks that TP splits are left out of the measured costs (their
        # times hold the TP all-reduces, which the planner adds itself)
        whole = {block_signature(measured, measured.block(n)) for st in plan.stages for n in st.block_names
                 if not tp_splits(measured.block(n), st.tp_degree)}
        assert set(costs.times) == whole and all(k[1] == 1 for t in costs.times.values() for k in t)
    (_, _, _, seen0, _), _ = runs["ranks"][0]
    (_, _, _, seen1, _), _ = runs["ranks"][1]
    assert seen0.step_s == seen1.step_s  # the slowest rank's time, on every rank


def test_recomputation_is_measured_and_charged(measured, tmp_path, monkeypatch):
    """measure=True times the model with every block checkpointed as the runtime checkpoints them against
    the plain step; what that adds per second of the blocks' forward (the checkpoint's own work beside a
    second forward: on this CPU 1.2-1.7x) is what the planner charges a checkpointed block's recompute,
    in place of its forward once more; the table round-trips through its JSON."""
    from whalepy.ir.measured import MeasuredCosts

    monkeypatch.setenv("WHALEPY_DEVICE_PROFILES", str(tmp_path))
    ratios = measured.measured.recompute_ratio["fp32"]
    assert set(ratios) <= {1.0, 2.0, 4.0} and ratios and all(r > 0 for r in ratios.values())
    assert MeasuredCosts.from_dict(measured.measured.to_dict()).recompute_ratio == measured.measured.recompute_ratio
    ctx = CostContext(measured, Hardware(ClusterSpec.local(2)), precision="fp32")
    layer = next(b for b in measured.blocks if b.kind.value == "layer")
    from whalepy.planner.space import Segment

    mb = max(ratios)
    costs = ctx.segment_costs((Segment(index=0, start=layer.index, blocks=(layer,)),), "CPU", 1, mb, None)
    fwd = ctx.block_time(layer.index, "CPU", 1, mb)[0]
    assert costs[1][0] == pytest.approx(fwd * ratios[mb], rel=1e-12)
    bare = CostContext(dataclasses.replace(measured, measured=dataclasses.replace(measured.measured, recompute_ratio={})),
                       Hardware(ClusterSpec.local(2)), precision="fp32")
    seg = (Segment(index=0, start=layer.index, blocks=(layer,)),)
    assert bare.segment_costs(seg, "CPU", 1, mb, None)[1][0] == pytest.approx(fwd, rel=1e-12)


def test_a_profile_measured_on_another_device_type_is_not_used_and_the_plan_says_so(measured, tmp_path,
                                                                                      monkeypatch):
    """A profile measured on one device type (here the CPU's tables relabelled, as a GPU host's default
    would give) planning a cluster of another: the planner models every cost, as for an unmeasured
    profile, and the plan's notes say the measurements went unused and how to measure the right ones."""
    import dataclasses

    monkeypatch.setenv("WHALEPY_DEVICE_PROFILES", str(tmp_path))
    elsewhere = dataclasses.replace(measured, measured=dataclasses.replace(measured.measured, device_type="H200"))
    got = plan_from_profile(elsewhere, ClusterSpec.local(2), global_batch=4, time_limit_s=20)
    plain = plan_from_profile(dataclasses.replace(measured, measured=None), ClusterSpec.local(2), global_batch=4,
                              time_limit_s=20)
    assert got.cost.step_time_s == plain.cost.step_time_s
    said = [n for n in got.notes if "measurements are of H200" in n]
    assert len(said) == 1 and "(CPU)" in said[0] and "device=" in said[0], got.notes
    assert not any(n.startswith("stage ") and "measured for" in n for n in got.notes)


def test_parallelize_plans_from_the_measured_profile_it_is_given(measured, tmp_path, monkeypatch):
    """parallelize(profile=<a measured profile>) plans from that profile (as plan_from_profile does), not
    from a fresh capture that would drop its measured tables (it did: on an H200 the measured profile
    was ignored and an analytic plan chosen)."""
    monkeypatch.setenv("WHALEPY_DEVICE_PROFILES", str(tmp_path))
    model, x, _ = build()
    cluster = ClusterSpec.local(2)
    want = plan_from_profile(measured, cluster, global_batch=4, time_limit_s=20)
    got = whalepy.parallelize(model, cluster, example_inputs=(x,), loss_fn=lambda o, t: o.mean(),
                              optimizer=lambda ps: torch.optim.AdamW(ps), global_batch=4, profile=measured,
                              time_limit_s=20).plan
    assert got.cost.step_time_s == want.cost.step_time_s
    assert any("measured for" in n for n in got.notes)
    fresh = whalepy.parallelize(model, cluster, example_inputs=(x,), loss_fn=lambda o, t: o.mean(),
                                optimizer=lambda ps: torch.optim.AdamW(ps), global_batch=4, time_limit_s=20).plan
    assert not any("measured for" in n for n in fresh.notes)


def test_the_block_clock_adds_nothing_to_the_autograd_graph_and_cuts_every_block():
    """The clock marks a block's backward with tensor hooks on its outputs, not full backward hooks
    (which wrap every input and output in an autograd function of their own: 2% of a small GPT's step
    on a CPU, about 4% on an H200, carried into the measured block times). The graph the timed step
    runs is the model's own, and every block still gets a forward and a backward interval."""
    from whalepy.frontend.measure import BlockClock, _one_step, default_loss

    model, x, _ = build()
    prof = whalepy.profile(model, (x,))
    blocks = {b.index: b.modules for b in prof.blocks}

    def nodes() -> int:
        seen, todo = set(), [default_loss(model(x), (x,)).grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            todo += [f for f, _ in fn.next_functions]
        return len(seen)

    plain = nodes()
    clock = BlockClock(model, blocks, lambda: None)
    try:
        assert nodes() == plain
        got = _one_step(model, (x,), clock, default_loss, contextlib.nullcontext, max(blocks))
    finally:
        clock.remove()
    assert set(got) == {(i, p) for i in blocks for p in ("f", "b")}
    assert all(t > 0 for t in got.values())


def test_the_timed_blocks_sum_to_the_step_without_the_clock_when_the_hooks_cost_time():
    """Where the clock's hooks cost host time the step does not (a small model on a GPU is bound by its
    kernel launches: an H200's GPT of 8 x 512 summed to 17.9 ms clocked against 14.5 ms plain), the
    measured blocks are scaled to the plain step, timed in alternation with the clocked one. Here the
    clock is made costly on purpose (a 1.5 ms busy wait per mark): the raw intervals sum to the step
    and the waits, the measured ones to the step, and every block keeps a share."""
    import statistics
    import time

    from whalepy.frontend import measure as M
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, num_layers=4, num_heads=4, hidden_size=128))
    x = torch.randint(0, 256, (8, 64))
    blocks = {0: ("transformer.wte", "transformer.wpe")} | {
        i + 1: (f"transformer.h.{i}",) for i in range(4)} | {5: ("transformer.ln_f", "lm_head")}
    nothing = contextlib.nullcontext

    class SlowClock(M.BlockClock):
        def mark(self, block, phase):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 1.5e-3:
                pass
            super().mark(block, phase)

    def plain() -> float:
        return statistics.median(M._plain_step(model, (x,), M.default_loss, nothing, lambda: None) for _ in range(7))

    before = plain()
    clock = SlowClock(model, blocks, lambda: None)
    try:
        raw = M._median_times([M._one_step(model, (x,), clock, M.default_loss, nothing, 5) for _ in range(7)])
        marks = len(clock.events)  # the marks of one step: all but the first cost inside an interval
        got = M._timed_steps(model, (x,), clock, M.default_loss, nothing, 5, repeats=7)
    finally:
        clock.remove()
    after = plain()
    # the costly clock adds its 1.5 ms per mark to what it times (most of it: the medians are per block) ...
    assert sum(raw.values()) - sum(got.values()) > 0.5 * (marks - 1) * 1.5e-3
    # ... and the measured blocks sum to the step without it, timed before and after (the machine's load
    # may drift between them: the range of the two, with 20% either side)
    assert 0.8 * min(before, after) <= sum(got.values()) <= 1.2 * max(before, after)
    assert set(got) == set(raw) and all(t > 0 for t in got.values())  # every block keeps its share
    assert not clock.handles and not model.transformer.h[0]._forward_pre_hooks  # removed, not re-attached


def test_the_optimizer_step_is_timed_as_the_runtime_steps_it_with_tied_weights_once():
    """One optimizer over every block's parameters (what the runtime builds per stage), a tied embedding
    and head stepped once: on an H200 each block stepped alone cost 0.2 ms of launch and host work per
    block more, and a Llama's tied head was stepped twice (19.6 ms predicted, 10.2 ms measured)."""
    from whalepy.frontend.measure import block_parameters, measure_costs
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, num_layers=2, num_heads=2, hidden_size=32,
                          tie_embeddings=True))
    x = torch.randint(0, 64, (2, 16))
    prof = whalepy.profile(model, (x,))
    m = measure_costs(model, (x,), prof, micro_batches=(2,), repeats=1, lowered=False)
    unique = {id(p): p.numel() for p in model.parameters()}
    sigs = {b.name: block_signature(prof, b) for b in prof.blocks}
    assert m.optimizer_step is not None and m.optimizer_step[0] > 0
    assert m.optimizer_step[1] == sum(unique.values())  # the tied weight once
    assert sum(b.num_params for b in prof.blocks) == sum(unique.values())  # the profile counts it once too
    # the head's weight is the embedding's: the embedding block steps it, the head its final norm only
    blocks = {b.index: b.modules for b in prof.blocks}
    owned = block_parameters(model, blocks)
    assert sum(p.numel() for ps in owned.values() for p in ps) == sum(unique.values())
    tied = model.transformer.wte.weight
    assert any(p is tied for p in owned[prof.blocks[0].index])
    assert not any(p is tied for p in owned[prof.blocks[-1].index]) and owned[prof.blocks[-1].index]
    rate = m.optimizer_s_per_param((sigs[b.name], b.num_params) for b in prof.blocks)
    assert rate == m.optimizer_step[0] / m.optimizer_step[1]
    assert MeasuredCosts.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    # a table written before the joint step was measured still loads, and charges the blocks' sum
    old = m.to_dict()
    del old["optimizer_step"]
    legacy = MeasuredCosts.from_dict(old)
    assert legacy.optimizer_step is None
    assert legacy.optimizer_s_per_param((sigs[b.name], b.num_params) for b in prof.blocks) == pytest.approx(
        sum(m.updates[sigs[b.name]] for b in prof.blocks) / sum(b.num_params for b in prof.blocks))


def test_measured_costs_round_trip_through_a_device_profile(measured, tmp_path, monkeypatch):
    m = measured.measured
    assert MeasuredCosts.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    path = write_measured(m, tmp_path / "CPU.json")
    monkeypatch.setenv("WHALEPY_DEVICE_PROFILES", str(tmp_path))
    from whalepy.cost_models.device_profiles import resolve_compute_profile
    from whalepy.cost_models.devices import CATALOG

    assert resolve_compute_profile(CATALOG["CPU"]).measured == m
    # the file's measurements drive a profile made without measure=True
    plain = whalepy.profile(build()[0], (build()[1],))
    ctx = CostContext(plain, Hardware(ClusterSpec.local(1)), precision="fp32")
    assert ctx.block_cost_source(1, "CPU", 1) == "measured"
    data = json.loads(path.read_text())
    data["measured"]["format"] = 99
    path.write_text(json.dumps(data))
    from whalepy.cost_models.device_profiles import forget_resolved_profiles

    forget_resolved_profiles()
    with pytest.raises(WhalepyError, match="format 99 is not supported"):
        resolve_compute_profile(CATALOG["CPU"])
    forget_resolved_profiles()


def test_calibrate_model_writes_a_measured_profile(tmp_path, monkeypatch, capsys):
    from whalepy.tools.cli import main
    from whalepy.cost_models.device_profiles import forget_resolved_profiles, load_profile_file

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    assert main(["calibrate", "--model", "measured_cases:cli_model", "--micro-batches", "2",
                 "--tp-degrees", "1", "--out", str(tmp_path)]) == 0
    m = load_profile_file(tmp_path / "CPU.json").measured
    assert len(m.times) == 3 and all(set(t) == {("fp32", 1, 2.0)} for t in m.times.values())
    assert main(["calibrate", "--import", str(tmp_path / "CPU.json")]) == 2  # --import needs --model
    assert "needs --model" in capsys.readouterr().err
    forget_resolved_profiles()


def test_imported_layer_table_drives_a_plan(measured, tmp_path, monkeypatch):
    n = len(measured.blocks)
    # a per-layer table as another system writes it: fwd 1 ms + 0.5 ms per sample, bwd twice that
    table = {"profiles": {"tiny": {"GPU-X": {str(mb): {"1": {str(i): [1e-3 + 5e-4 * mb, 2e-3 + 1e-3 * mb, 1e-4]
                                                              for i in range(n)}} for mb in (1, 2, 4)}}}}
    src = tmp_path / "layers.json"
    src.write_text(json.dumps(table))
    (m,) = import_layer_table(src, measured, device_types={"GPU-X": "T4"})
    write_measured(m, tmp_path / "T4.json")
    monkeypatch.setenv("WHALEPY_DEVICE_PROFILES", str(tmp_path))
    from whalepy.cost_models.device_profiles import forget_resolved_profiles

    forget_resolved_profiles()
    cluster = ClusterSpec.local(1, device_type="T4")
    plain = whalepy.profile(build()[0], (build()[1],))
    plan = plan_from_profile(plain, cluster, global_batch=4, time_limit_s=20, allow_checkpointing=False,
                             allow_offload=False, allow_activation_offload=False)
    mb = 4 / plan.num_microbatches
    per_mb = n * (3e-3 + 1.5e-3 * mb)
    assert plan.stages[0].cost.compute_s == pytest.approx(per_mb, rel=1e-6)
    assert "measured for" in " ".join(plan.notes)
    with pytest.raises(WhalepyError, match="has 2 layers"):
        bad = {"profiles": {"tiny": {"GPU-X": {"1": {"1": {"0": [1, 1, 1], "1": [1, 1, 1]}}}}}}
        src.write_text(json.dumps(bad))
        import_layer_table(src, measured)
    forget_resolved_profiles()


def test_blocks_are_measured_as_the_runtime_lowers_them(measured, tmp_path, monkeypatch):
    """measure=True also lowers the model with the runtime's own wrappers on a fake process group (FSDP2
    keeping parameters gathered, FSDP2 resharding, DTensor TP 2) and times each block and its optimizer
    step there; the planner adds exactly the wrapper's measured host work to the layouts that use it."""
    import dataclasses

    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

    monkeypatch.setenv("WHALEPY_DEVICE_PROFILES", str(tmp_path))
    m = measured.measured
    sigs = {block_signature(measured, b) for b in measured.blocks}
    for sig in sigs:
        for wrapper in ("fsdp", "fsdp_reshard"):
            for mb in (1.0, 2.0, 4.0):
                f, b = m.wrapped[sig][("fp32", wrapper, mb)]
                assert f > 0 and b > 0
        assert m.wrapped_updates[sig]["fsdp/2"] > 0
    assert any("tp/2" in m.wrapped_updates[s] for s in sigs)
    # the TP collectives each block issues, counted: a layer all-reduces once after attention and once
    # after the MLP in forward, and once per input in backward (q/k/v share one; runtime/tensor_parallel.py)
    layer = next(b for b in measured.blocks if b.kind.value == "layer")
    counted = m.tp_collectives[block_signature(measured, layer)][2]
    assert counted["f"]["all_reduce"][0] == 2 and counted["b"]["all_reduce"][0] == 2, counted
    assert counted["f"]["all_reduce"][1] == counted["b"]["all_reduce"][1] > 0
    # FSDP2's units per block, counted: the embedding block is two (token and position tables), each
    # gathering in a call of its own, which the data-parallel cost charges
    embed = measured.blocks[0]
    assert m.fsdp_units[block_signature(measured, embed)] == 2 and m.fsdp_units[block_signature(measured, layer)] == 1
    assert CostContext(measured, Hardware(ClusterSpec.local(2)), precision="fp32").fsdp_units(embed.index) == 2
    cluster = ClusterSpec.local(2)
    bare = dataclasses.replace(measured, measured=dataclasses.replace(m, wrapped={}, wrapped_updates={}))
    ctx = CostContext(measured, Hardware(cluster), precision="fp32")
    for zero, wrapper in ((3, "fsdp_reshard"), (2, "fsdp")):
        cfg = ParallelConfig(dp=2, zero_stage=zero)
        with_host = estimate_from_profile(measured, cluster, cfg, global_batch=4).step_time_s
        without = estimate_from_profile(bare, cluster, cfg, global_batch=4).step_time_s
        extra = sum(ctx.wrapper_overhead(b.index, "CPU", wrapper, 2.0)
                    + ctx.update_overhead(b.index, "CPU", fsdp=True, tp=1) for b in measured.blocks)
        assert extra > 0 and with_host - without == pytest.approx(extra, rel=1e-6)
    # DDP (ZeRO-0) is not FSDP2: nothing is added
    ddp = ParallelConfig(dp=2)
    assert (estimate_from_profile(measured, cluster, ddp, global_batch=4).step_time_s
            == estimate_from_profile(bare, cluster, ddp, global_batch=4).step_time_s)


def test_tp_blocks_are_measured_under_a_multi_tensor_optimizer(caplog):
    """A TP-2 block holds DTensor shards beside plain norm parameters; torch's multi-tensor AdamW (its
    default on CUDA) refused that mix, so on a GPU the lowered TP measurement failed and the planner fell
    back to the model (an H200, 2026-11-27). Stepped as the runtime steps it (optimizer_impl.
    split_mixed_groups), the TP step and its optimizer update are measured."""
    import logging

    model, x, _ = build()
    with caplog.at_level(logging.WARNING, logger="whalepy"):
        prof = whalepy.profile(model, (x,), measure=True, device="cpu", micro_batches=(2,), tp_degrees=(1, 2),
                               repeats=1, optimizer=lambda ps: torch.optim.AdamW(ps, foreach=True))
    assert not [r for r in caplog.records if "could not be measured" in r.getMessage()], caplog.text
    m = prof.measured
    layer = next(b for b in prof.blocks if b.kind.value == "layer")
    assert m.wrapped_updates[block_signature(prof, layer)]["tp/2"] > 0


def test_compiled_blocks_are_measured_when_the_plan_compiles(monkeypatch, tmp_path):
    """measure(compile=True) times the blocks compiled as the runtime compiles them (Plan.compile:
    runtime.compile_blocks, here with the aot_eager backend: inductor's C++ build is minutes on CI), and a
    plan that compiles is costed from those times; an eager plan keeps the eager ones."""
    from whalepy.runtime import compile_blocks

    monkeypatch.setattr(compile_blocks, "BACKEND", "aot_eager")
    monkeypatch.setenv("WHALEPY_DEVICE_PROFILES", str(tmp_path))
    model, x, _ = build(2)
    prof = whalepy.profile(model, (x,), measure=True, micro_batches=(2,), tp_degrees=(1,), repeats=1, compile=True)
    m = prof.measured
    sigs = {block_signature(prof, b) for b in prof.blocks}
    assert set(m.compiled) == sigs and all(m.compiled[s][("fp32", 1, 2.0)][0] > 0 for s in sigs)
    assert all(("fp32", "fsdp_reshard/compiled", 2.0) in m.wrapped[s] for s in sigs)
    # what the compiled blocks save for backward, counted in the lowered plain (compiled) run, beside the eager
    assert all(("fp32", True, 2.0) in m.saved[s] and ("fp32", False, 2.0) in m.saved[s] for s in sigs)
    assert any(m.saved[s][("fp32", True, 2.0)] > 0 for s in sigs)
    cluster = ClusterSpec.local(1)
    eager = CostContext(prof, Hardware(cluster), precision="fp32")
    compiled = CostContext(prof, Hardware(cluster), precision="fp32", compile=True)
    for b in prof.blocks:
        sig = block_signature(prof, b)
        assert compiled.block_time(b.index, "CPU", 1, 2.0) == m.compiled[sig][("fp32", 1, 2.0)]
        assert eager.block_time(b.index, "CPU", 1, 2.0) == m.times[sig][("fp32", 1, 2.0)]
    assert MeasuredCosts.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    with pytest.raises(WhalepyError, match="compile"):
        whalepy.profile(model, (x,), measure=True, compile=True, lowered=False)
    # a compiling plan whose compiled blocks were not timed (the lowered timing failed) says so
    import dataclasses

    timed = plan_from_profile(prof, cluster, global_batch=2, compile=True, time_limit_s=20)
    assert not any("compiled blocks timed for" in n for n in timed.notes)
    eager_only = dataclasses.replace(prof, measured=dataclasses.replace(m, compiled={}))
    untimed = plan_from_profile(eager_only, cluster, global_batch=2, compile=True, time_limit_s=20)
    assert any(f"compiled blocks timed for 0 of {len(prof.blocks)}" in n for n in untimed.notes), untimed.notes
    # where the lowered timing cannot run, the compiled blocks are timed in this process instead
    from whalepy.frontend import measure as measure_mod

    monkeypatch.setattr(measure_mod, "_measure_as_lowered", lambda *a, **k: ({}, {}, {}, {}, {}, {}))
    alone = whalepy.profile(model, (x,), measure=True, micro_batches=(1, 2), tp_degrees=(1,), repeats=1,
                            compile=True).measured
    assert set(alone.compiled) == sigs and not alone.wrapped
    assert all(set(alone.compiled[s]) == {("fp32", 1, 1.0), ("fp32", 1, 2.0)} for s in sigs)
    assert all(f > 0 and b > 0 for s in sigs for f, b in alone.compiled[s].values())
    assert all({k for k in alone.saved[s] if k[1]} == {("fp32", True, 1.0), ("fp32", True, 2.0)} for s in sigs)


def test_inside_a_distributed_job_the_lowered_timing_runs_in_another_process():
    """A rank of a torch.distributed job (bench_gpu_step.py, parallelize(measure=True) under torchrun)
    cannot make the fake process group the lowered timing needs; it runs in a fresh process instead and
    records the same tables."""
    from measured_cases import measure_in_a_job

    (wrapped, units, updates), = run_distributed(measure_in_a_job, 1, timeout=240)
    assert wrapped == 3 and units == 4 and updates == 3  # embed (2 units), a layer, the head


def test_closed_loop_replans_from_what_a_run_measured(runs, tmp_path, monkeypatch):
    """A 2-stage pipeline's run times every block on its 6th step; measured_profile() holds them all
    (both stages', on every rank), the estimate of the same layout from it charges exactly those times
    and predicts that step better than the modelled plan did; plan(profile=...) re-plans from it, and
    the measured costs round-trip through a device-profile file."""
    from whalepy.cost_models.device_profiles import forget_resolved_profiles, load_profile_file
    from whalepy.planner.estimate import estimate_from_profile
    from whalepy.runtime._block_timing import merge_measured

    monkeypatch.setenv("WHALEPY_DEVICE_PROFILES", str(tmp_path))  # the CPU's modelled costs, no stray file
    forget_resolved_profiles()
    prof, cfg, before = runs["plain"], runs["cfg"], runs["before"]
    cluster = ClusterSpec.local(2)
    got = [r[1] for r in runs["ranks"]]
    ref = reference_losses(STEPS)
    for losses, early, _, _, _ in got:
        assert losses == pytest.approx(ref, rel=1e-4, abs=1e-5)  # the hooks change no numerics
        assert early is None  # not before the sampled step
    (_, _, m, observed, logged), (_, _, m1, _, logged1) = got
    # rank 0 says once that the plan is off (if it is), pointing at measured_profile(), and reports the
    # sampled step once; rank 1 says nothing
    assert len(logged[0]) == (abs(observed.step_ratio - 1) > 0.15) and len(logged[1]) == 1
    assert logged1 == ([], [])
    assert m == m1  # gathered: every rank holds both stages' blocks
    timing = observed.timing
    names = [b.name for b in prof.blocks]
    assert [b.name for b in timing.blocks] == names
    assert {b.stage for b in timing.blocks} == {0, 1} and len(timing.stages) == 2
    sigs = [block_signature(prof, b) for b in prof.blocks]
    assert set(m.times) == set(sigs) and m.device_type == "CPU"
    key = ("fp32", 1, 2.0)  # fp32, TP 1, 2 samples per micro-batch
    for b, t in zip(prof.blocks, timing.blocks):
        f, bwd = m.times[block_signature(prof, b)][key]
        same = [u for u, s in zip(timing.blocks, sigs) if s == block_signature(prof, b)]
        assert f == pytest.approx(sum(u.forward_s for u in same) / len(same)) and f > 0 and bwd > 0
    for s in timing.stages:
        assert s.step_s >= s.compute_s > 0 and s.optimizer_s > 0
    measured = merge_measured(prof, m)
    # the same layout estimated from the measured profile charges exactly the recorded block times
    after = estimate_from_profile(measured, cluster, cfg, global_batch=4)
    ctx = CostContext(measured, Hardware(cluster), precision="fp32")
    for st in after.plan.stages:
        idx = [names.index(n) for n in st.block_names]
        assert all(ctx.block_time(i, "CPU", 1, 2.0) == m.times[sigs[i]][key] for i in idx)
        assert st.cost.compute_s == pytest.approx(sum(sum(m.times[sigs[i]][key]) for i in idx), rel=1e-9)
    assert any("measured for" in n for n in after.plan.notes)
    # ... and predicts the step it timed better than the modelled plan did
    step = timing.step_s
    assert abs(after.step_time_s - step) < abs(before.step_time_s - step), (before.step_time_s, after.step_time_s, step)
    replanned = whalepy.plan(build()[0], cluster, profile=measured, global_batch=4, time_limit_s=20)
    assert any(n.startswith("stage 0 costs:") and "measured for" in n for n in replanned.notes)
    path = write_measured(m, tmp_path / "CPU.json")
    assert load_profile_file(path).measured == m
    for kw, needle in (({"profile": None}, "example_inputs is None"), ({"profile": m}, "takes a whalepy.ModelProfile"),
                       ({"profile": measured, "measure": True}, "drop measure=True")):
        with pytest.raises(WhalepyError, match=needle):
            whalepy.plan(build()[0], cluster, global_batch=4, **kw)
    forget_resolved_profiles()


def test_an_optimizer_factory_that_does_not_pickle_travels_as_its_class_and_settings():
    """The lowered timing in another process gets the optimizer the user's factory builds, also when the
    factory is a lambda (which pickle refuses): the same class with the same hyper-parameters."""
    import pickle

    from whalepy.frontend.measure import portable_optimizer

    factory = lambda ps: torch.optim.AdamW(ps, lr=0.5, betas=(0.8, 0.9), weight_decay=0.25)  # noqa: E731
    again = pickle.loads(pickle.dumps(portable_optimizer(factory)))
    p = [torch.nn.Parameter(torch.zeros(3))]
    a, b = factory(p), again(p)
    assert type(a) is type(b) and a.defaults == b.defaults
    sgd = torch.optim.SGD  # a factory that pickles is sent as it is
    assert portable_optimizer(sgd) is sgd and portable_optimizer(None) is None


def test_a_measured_size_gives_its_own_times_exactly():
    """Between measured micro-batch sizes the times are interpolated; at a measured size they are that
    size's own, to the bit (the segment's end point ``t0 + (t1 - t0)`` is not: 0.1 + (0.3 - 0.1) is
    0.30000000000000004), so a plan at a measured size charges what was measured."""
    from whalepy.ir.measured import _interpolate

    rows = [(1.0, (0.1, 0.2)), (2.0, (0.3, 0.7)), (4.0, (0.5, 1.1))]
    assert [_interpolate(rows, mb) for mb in (1.0, 2.0, 4.0)] == [(0.1, 0.2), (0.3, 0.7), (0.5, 1.1)]
    assert _interpolate(rows, 3.0) == pytest.approx((0.4, 0.9))
    assert _interpolate(rows, 8.0) == pytest.approx((0.9, 1.9))
