"""The planner finds what an expert would, and honours every annotation as a hard constraint."""

from __future__ import annotations

import pytest

from whalepy.errors import AnnotationError, InfeasibleError, PlanError
from whalepy.planner import homogeneous_baseline, plan_from_profile
from whalepy.planner.synthetic import gpt_profile, transformer_profile
from whalepy.ir.profile import BlockAnnotations

from planner_fixtures import a100, cluster, group


@pytest.fixture(scope="module")
def gpt3_plan():  # type: ignore[no-untyped-def]
    # Tensor parallelism with sequence parallelism, as large runs use it (Korthikanti et al. 2022).
    return plan_from_profile(gpt_profile("gpt3-175b", sequence_parallel=True), a100(128), global_batch=1536,
                             sequence_parallel=True)


def test_175b_on_1024_a100_sequence_parallel_tp_inside_nodes_no_pipeline(gpt3_plan) -> None:  # type: ignore[no-untyped-def]
    p = gpt3_plan
    assert p.world_size == 1024
    assert all(t in (2, 4, 8) for t in p.tp_degrees)
    # the sequence-sharded residual stream cannot cross pipeline stages (whalepy.ir.rules): the
    # runtime refuses sequence parallelism with pp > 1, so the planner never offers it
    assert p.pp_degree == 1
    assert any("cannot cross pipeline stages" in a.reason for a in p.alternatives), p.explain()
    for s in p.stages:  # every TP group sits on consecutive local ranks of one node
        for row in s.ranks:
            assert len({r // 8 for r in row}) == 1
    assert p.solver.status in ("optimal", "feasible")
    assert 0.2 < p.cost.mfu < 0.75


def test_175b_without_sequence_parallelism_keeps_tp_inside_nodes() -> None:
    # Without sequence parallelism a TP rank keeps 10/34 of a layer's activations whole, so the 175B
    # model needs checkpointing or ZeRO-3 to fit; whatever wins, TP never leaves a node.
    p = plan_from_profile(gpt_profile("gpt3-175b"), a100(128), global_batch=1536)
    assert all(t in (1, 2, 4, 8) for t in p.tp_degrees)
    for s in p.stages:
        for row in s.ranks:
            assert len({r // 8 for r in row}) == 1
    # pipeline stages, if any, span different nodes
    assert len({s.ranks[0][0] // 8 for s in p.stages}) == p.pp_degree
    assert all(st.cost.memory_bytes <= st.cost.capacity_bytes for st in p.stages)


def test_1_3b_on_one_node_uses_data_parallel_or_zero_without_pipeline() -> None:
    p = plan_from_profile(gpt_profile("gpt3-1.3b"), a100(1), global_batch=64)
    assert p.pp_degree == 1
    assert p.dp_degree >= 4


def _small(**annotations: BlockAnnotations):  # type: ignore[no-untyped-def]
    return transformer_profile(num_layers=8, hidden=1024, seq_len=1024, vocab=32000, num_heads=16,
                               annotations={k.replace("_", "."): v for k, v in annotations.items()})


def _layers(ann: BlockAnnotations) -> dict[str, BlockAnnotations]:
    return {f"h_{i}": ann for i in range(8)}


def test_split_fixes_tensor_parallel_degree() -> None:
    ann = BlockAnnotations(split=4, sources=("split(4) on h.*",))
    p = plan_from_profile(_small(**_layers(ann)), a100(1), global_batch=32)
    assert set(p.tp_degrees) == {4}
    assert any("split(4)" in n for n in p.notes)
    assert p.tensor_parallel


def test_replicate_fixes_data_parallel_degree() -> None:
    ann = BlockAnnotations(replicate=2, sources=("replicate(2) on h.*",))
    p = plan_from_profile(_small(**_layers(ann)), a100(1), global_batch=32)
    assert p.dp_degree == 2


def test_replicate_without_degree_forbids_tp() -> None:
    ann = BlockAnnotations(replicate=0, sources=("replicate() on h.*",))
    p = plan_from_profile(_small(**_layers(ann)), a100(1), global_batch=32)
    assert set(p.tp_degrees) == {1}


def test_stage_scopes_fix_boundaries() -> None:
    anns = {f"h_{i}": BlockAnnotations(stage=0 if i < 3 else 1, sources=(f"stage() #{0 if i < 3 else 1}",))
            for i in range(8)}
    p = plan_from_profile(_small(**anns), a100(1), global_batch=32)
    assert p.pp_degree == 2
    assert {"h.0", "h.1", "h.2"} <= set(p.stages[0].block_names)
    assert {"h.3", "h.7"} <= set(p.stages[1].block_names)


def test_cluster_pin_places_blocks_on_group() -> None:
    c = cluster(group("fast", "A100-80GB", 4, 1, link="nvswitch"), group("slow", "V100-32GB", 4, 1, link="nvlink2"))
    anns = {"head": BlockAnnotations(cluster_group="slow", sources=("cluster(group='slow') on head",))}
    p = plan_from_profile(_small(**anns), c, global_batch=32)
    stage = next(s for s in p.stages if "head" in s.block_names)
    assert set(stage.device_types) == {"V100-32GB"}


def test_cluster_pin_to_missing_group_is_an_annotation_error() -> None:
    anns = {"head": BlockAnnotations(cluster_group="nope", sources=("cluster(group='nope') on head",))}
    with pytest.raises(AnnotationError, match="nope"):
        plan_from_profile(_small(**anns), a100(1), global_batch=32)


def test_annotation_that_makes_memory_impossible_is_named() -> None:
    prof = gpt_profile("gpt3-175b", annotations={
        f"h.{i}": BlockAnnotations(replicate=16, sources=("replicate(16) on transformer.h.*",)) for i in range(96)})
    c = a100(2)  # 16 GPUs: replicate(16) leaves no room for TP or pipelining
    with pytest.raises(InfeasibleError) as e:
        plan_from_profile(prof, c, global_batch=64, allow_offload=False)
    msg = str(e.value)
    assert "replicate(16)" in msg and "short" in msg and "'a100s'" in msg and "A100-80GB" in msg


def test_infeasible_without_annotations_suggests_fixes() -> None:
    with pytest.raises(InfeasibleError) as e:
        plan_from_profile(gpt_profile("gpt3-175b"), a100(1), global_batch=8, allow_offload=False,
                          max_microbatches=4)
    msg = str(e.value)
    assert "GiB short" in msg and "more devices" in msg


def test_device_below_the_fixed_reserve_is_named_before_planning() -> None:
    """A device with no more memory than the CUDA context and one NCCL communicator take has nothing left
    for the allocator: a one-line InfeasibleError naming it, from the planner and from estimate."""
    from whalepy.planner.estimate import estimate_from_profile

    from planner_fixtures import tiny_device

    dev = tiny_device("t4-0.5g", "T4", 0.5)
    c = cluster(group("small", dev.name, 2, 1, custom={dev.name: dev}), custom=[dev])
    prof = transformer_profile(num_layers=1, hidden=256, seq_len=128, vocab=8000, num_heads=8)
    for call in (lambda: plan_from_profile(prof, c, global_batch=2, precision="fp16"),
                 lambda: estimate_from_profile(prof, c, dict(dp=2), global_batch=2, precision="fp16")):
        with pytest.raises(InfeasibleError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "'t4-0.5g'" in msg and "'small'" in msg, msg
        assert "0.5 GiB of memory" in msg and "0.625 GiB reserved" in msg, msg


def test_options_are_validated() -> None:
    with pytest.raises(PlanError, match="solver"):
        plan_from_profile(_small(), a100(1), global_batch=8, solver="gurobi")
    with pytest.raises(PlanError, match="zero_stages"):
        plan_from_profile(_small(), a100(1), global_batch=8, zero_stages=(5,))
    with pytest.raises(PlanError, match=r"unknown planner option 'time_limit'.*did you mean time_limit_s"):
        plan_from_profile(_small(), a100(1), global_batch=8, time_limit=1)
    with pytest.raises(PlanError, match="virtual_stages"):
        plan_from_profile(_small(), a100(1), global_batch=8, virtual_stages=())


def test_exhaustive_refuses_large_instances() -> None:
    with pytest.raises(PlanError, match="exhaustive"):
        plan_from_profile(gpt_profile("gpt3-1.3b"), a100(1), global_batch=64, solver="exhaustive")


@pytest.mark.parametrize("groups", [
    (("v100", "V100-32GB", 8, 1, "nvlink2"), ("t4", "T4", 8, 1, "pcie3")),
    (("p100", "P100", 4, 2, "nvlink1"), ("v100", "V100-32GB", 4, 2, "nvlink2")),
])
def test_hardware_aware_beats_homogeneous_baseline(groups) -> None:  # type: ignore[no-untyped-def]
    c = cluster(*(group(n, g, k, m, link=link, net_gbps=100) for n, g, k, m, link in groups))
    prof = gpt_profile("gpt2-xl")
    aware = plan_from_profile(prof, c, global_batch=128, max_microbatches=16)
    base = homogeneous_baseline(prof, c, global_batch=128, max_microbatches=16)
    assert aware.cost.samples_per_s >= 1.2 * base.cost.samples_per_s
    assert len(set(aware.rank_device_types)) == 2


def test_mixed_replicas_get_uneven_batch_shares() -> None:
    c = cluster(group("a", "A100-80GB", 4, 1, link="nvswitch", net_gbps=100),
                group("t", "T4", 4, 1, link="pcie3", net_gbps=100))
    p = plan_from_profile(gpt_profile("gpt3-1.3b", seq_len=1024), c, global_batch=128, max_microbatches=8)
    assert sum(p.batch_shares) == 128
    if p.pp_degree == 1 or len(set(p.stages[0].device_types)) == 2:
        shares = dict(zip(p.stages[0].device_types, p.batch_shares))
        assert shares["A100-80GB"] > shares["T4"]


def test_cluster_count_on_whole_group_is_honoured_and_on_part_of_it_refused() -> None:
    from whalepy import ClusterSpec

    spec = ClusterSpec.from_dict({"network": {"bandwidth_gbps": 100}, "groups": [
        {"name": "fast", "gpu": "A100-80GB", "gpus_per_node": 4, "intra_node": "nvlink3"},
        {"name": "slow", "gpu": "V100-32GB", "gpus_per_node": 4, "intra_node": "nvlink2"}]})
    whole = transformer_profile(num_layers=4, hidden=1024, seq_len=512, vocab=32000, num_heads=16, annotations={
        "embed": BlockAnnotations(cluster_group="fast", cluster_count=4, sources=("cluster(group=fast, count=4) on embed",))})
    p = plan_from_profile(whole, spec, global_batch=32)
    embed_stage = next(s for s in p.stages if "embed" in s.block_names)
    assert set(embed_stage.device_types) == {"A100-80GB"}
    part = transformer_profile(num_layers=4, hidden=1024, seq_len=512, vocab=32000, num_heads=16, annotations={
        "embed": BlockAnnotations(cluster_group="fast", cluster_count=2, sources=("cluster(group=fast, count=2) on embed",))})
    with pytest.raises(AnnotationError, match=r"count=2 asks for part.*node group of their own"):
        plan_from_profile(part, spec, global_batch=32)


def test_1f1b_plans_have_at_least_as_many_microbatches_as_stages() -> None:
    # torch.distributed.pipelining's Schedule1F1B refuses fewer micro-batches than stages, so the planner
    # must not emit such a plan (with few micro-batches GPipe is the schedule that runs).
    prof = transformer_profile(num_layers=24, hidden=4096, seq_len=2048, vocab=32000, num_heads=32)
    pipelined = 0
    for nodes, batch in ((2, 1), (4, 1), (4, 2), (8, 4)):  # batches too small for DP alone
        p = plan_from_profile(prof, a100(nodes), global_batch=batch, schedules=("gpipe", "1f1b"))
        pipelined += p.pp_degree > 1
        if p.schedule.value == "1f1b" and p.pp_degree > 1:
            assert p.num_microbatches >= p.pp_degree, p
    assert pipelined, "no case produced a pipeline; the check above tested nothing"
