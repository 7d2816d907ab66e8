"""A stage whose blocks have different memory tiers (granular offloading, as M6-10T's), on 2 gloo ranks.

One FSDP2 stage (pp 1, dp 2; also each of 2 pipeline stages) holds blocks on the device, on the host (FSDP2 ``CPUOffloadPolicy``), in
ZeRO-Offload form (device parameters, host optimizer) and on the disk tier, side by side, under ZeRO-3,
ZeRO-2 and ZeRO-1 (lowered to FSDP2 because blocks offload), and one DDP stage mixes device and disk
optimizer states. After 3 AdamW steps each must match the single-process run (losses 1e-5 relative,
parameters 1e-5 absolute: fp32, the same arithmetic in another order, the tolerances of the other
runtime tests) and hold on device, host and in files what the memory model predicts for the stage's
blocks, each with its own tiers (within 1%: FSDP2 pads shards, the disk tier aligns tensors to 64
bytes). A tied model (HF GPT-2, embedding tied to the head) checks that the root unit, which holds the
tied weight, follows the tiers of the blocks it belongs to, not another block's. Also: clipping with
gradients on the device, the host and in files; DCP save and resume of a mixed stage. All cases run in
one launch (workers: ``mixed_tiers_cases.py``).
"""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from mixed_tiers_cases import GPT4, mixed_cases, tiers
from runtime_cases import Case, build_model, case_profile
from whalepy.errors import PlanError, WhalepyError

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
HELD_RTOL = 0.01


def _case(name: str, zero: int, *pairs: str, kind: str = "gpt", **extra: object) -> Case:
    return Case(name, kind=kind, dp=2, zero=zero, num_layers=4, extra={"tiers": tiers(*pairs), **extra})


ZERO3 = _case("zero3 gpu|gpu|cpu|zero-offload|nvme|gpu", 3,
              "gpu/gpu", "gpu/gpu", "cpu/cpu", "gpu/cpu", "nvme/nvme", "gpu/gpu")
CASES = [
    ZERO3,
    _case("zero2 cpu|gpu-nvme|zero-offload|nvme-cpu|cpu-nvme|gpu", 2,
          "cpu/cpu", "gpu/nvme", "gpu/cpu", "nvme/cpu", "cpu/nvme", "gpu/gpu"),
    _case("zero1 gpu|cpu|gpu|nvme|zero-offload|gpu", 1,
          "gpu/gpu", "cpu/cpu", "gpu/gpu", "nvme/nvme", "gpu/cpu", "gpu/gpu"),
    # no block offloads through the host: DDP, states of two blocks in files
    _case("ddp gpu|gpu-nvme|gpu|gpu-nvme|gpu|gpu", 0,
          "gpu/gpu", "gpu/nvme", "gpu/gpu", "gpu/nvme", "gpu/gpu", "gpu/gpu"),
    # the root holds the tied embedding / head weight: it must stay on the device with them, while a
    # layer is on the host (the root used to take the first offloading block's policy)
    _case("tied zero3 gpu|cpu|gpu|cpu|gpu|gpu", 3,
          "gpu/gpu", "cpu/cpu", "gpu/gpu", "cpu/cpu", "gpu/gpu", "gpu/gpu", kind="hf_tied"),
    _case("tied zero3 cpu|gpu|gpu|gpu|gpu|cpu", 3,
          "cpu/cpu", "gpu/gpu", "gpu/gpu", "gpu/gpu", "gpu/gpu", "cpu/cpu", kind="hf_tied"),
    # two pipeline stages (one rank each), both mixed: the host and host-optimizer blocks in one, the
    # disk tier in the other
    Case("pp2 gpu|cpu|zero-offload + nvme|gpu|gpu", pp=2, zero=3, microbatches=2, schedule="gpipe", num_layers=4,
         extra={"tiers": tiers("gpu/gpu", "cpu/cpu", "gpu/cpu", "nvme/nvme", "gpu/gpu", "gpu/gpu")}),
    # clipping: gradients on the device, on the host and in files (0.05: below the norms of all 3 steps)
    _case("zero3 clipped gpu|cpu|nvme|gpu-nvme|gpu|gpu", 3,
          "gpu/gpu", "cpu/cpu", "nvme/nvme", "gpu/nvme", "gpu/gpu", "gpu/gpu", max_grad_norm=0.05),
    ("resume", ZERO3, ZERO3, "ckpt"),
]


@pytest.mark.distributed
def test_a_stage_of_mixed_tiers_matches_single_process_and_memory_model(tmp_path):
    per_rank = run_distributed(mixed_cases, 2, CASES, str(tmp_path), timeout=600)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(CASES)
        for r in results:
            assert r["loss_err"] <= LOSS_RTOL, (rank, r)
            assert r["param_err"] <= PARAM_ATOL, (rank, r)
            if "load_err" in r:  # resume: the loaded state is the one saved after two steps
                assert r["load_err"] <= PARAM_ATOL and not r["bad"], (rank, r)
                continue
            assert r["predicted"], r
            for place, predicted in r["predicted"].items():
                assert r["held"][place] == pytest.approx(predicted, rel=HELD_RTOL, abs=0), (rank, place, r)
            assert r["kind"] == ("ddp" if r["name"].startswith("ddp") else "fsdp2"), r
            if r["grad_norm"] is not None:  # clipping really engaged
                assert r["grad_norm"] > 0.05, r
            assert r["removed"], r


# -- refusals, before any work (no process group needed) -------------------------------------------


def test_blocks_sharing_a_weight_with_different_tiers_are_refused():
    """hf_tied's embedding and head share a weight, which FSDP2 keeps in the root unit: one offload
    policy for both, so different tiers for the two blocks are refused with a one-line whalepy error."""
    from whalepy.ir.plan import BlockPlan
    from whalepy.runtime.data_parallel import check_root_tiers, root_blocks

    model, prof = build_model("hf_tied", 4), case_profile("hf_tied", 4)

    def blocks(pairs: dict[str, tuple[str, str]]) -> list:
        return [(BlockPlan(name=b.name, param_tier=pairs.get(b.name, ("gpu", "gpu"))[0],
                           optimizer_tier=pairs.get(b.name, ("gpu", "gpu"))[1]),
                 [model.get_submodule(p) for p in b.modules]) for b in prof.blocks]

    assert {b.name for b in root_blocks(model, blocks({}))} == {"embed", "head"}
    check_root_tiers(model, blocks({"embed": ("cpu", "cpu"), "head": ("cpu", "cpu"),
                                    "transformer.h.1": ("nvme", "nvme")}))
    with pytest.raises(WhalepyError, match=r"blocks \['embed', 'head'\] share parameters .*\(cpu/cpu, gpu/gpu\)"):
        check_root_tiers(model, blocks({"embed": ("cpu", "cpu")}))


def test_make_plan_tiers_per_block():
    from whalepy.runtime import make_plan

    plan = make_plan(GPT4, dp=2, global_batch=8, zero_stage=3, optimizer_tier="cpu", param_tier="cpu",
                     tiers={"embed": ("gpu", "gpu"), "transformer.h.2": ("nvme", "nvme")})
    got = {b.name: (b.param_tier.value, b.optimizer_tier.value) for b in plan.stages[0].blocks}
    assert got == {"embed": ("gpu", "gpu"), "transformer.h.0": ("cpu", "cpu"), "transformer.h.1": ("cpu", "cpu"),
                   "transformer.h.2": ("nvme", "nvme"), "transformer.h.3": ("cpu", "cpu"), "head": ("cpu", "cpu")}
    with pytest.raises(PlanError, match=r"tiers names blocks \['transformer.h.9'\] that the model does not have"):
        make_plan(GPT4, global_batch=8, tiers={"transformer.h.9": ("cpu", "cpu")})
    with pytest.raises(PlanError, match=r"tiers\['head'\]: param_tier='cpu' with optimizer_tier='gpu' is not lowered"):
        make_plan(GPT4, global_batch=8, tiers={"head": ("cpu", "gpu")})
    with pytest.raises(PlanError, match=r"tiers\['head'\] = 'cpu': give a \(param_tier, optimizer_tier\) pair"):
        make_plan(GPT4, global_batch=8, tiers={"head": "cpu"})
    fp16 = make_plan(GPT4, global_batch=8, precision="fp16", tiers={"head": ("gpu", "cpu")})  # ZeRO-Offload
    assert fp16.stages[0].blocks[-1].optimizer_tier.value == "cpu"


def test_the_run_log_and_show_list_each_block_range_with_its_tiers():
    from whalepy.tools.show.page import _stages_table
    from whalepy.runtime import make_plan
    from whalepy.runtime._report import plan_log_lines

    plan = make_plan(GPT4, dp=2, global_batch=8, zero_stage=3, tiers=tiers(
        "gpu/gpu", "gpu/gpu", "cpu/cpu", "gpu/cpu", "nvme/nvme", "gpu/gpu"))
    want = ("embed, transformer.h.0 gpu/gpu; transformer.h.1 cpu/cpu prefetch 1; transformer.h.2 gpu/cpu; "
            "transformer.h.3 nvme/nvme prefetch 1; head gpu/gpu")
    assert f"tiers {want}" in plan_log_lines(plan)[1]
    assert want in _stages_table(plan)


def test_the_stage_memory_model_of_one_tier_pair_is_the_block_model():
    """A stage of one tier pair costs what ``estimate_model_state_bytes`` costs; a mixed stage shares
    its lowering (FSDP2 once a block offloads) and one staging pool, so it is not the per-block sum."""
    from whalepy.ir.rules import state_option_error
    from whalepy.cost_models.memory import estimate_model_state_bytes, estimate_stage_model_state_bytes

    pairs = [(p, o) for p in ("gpu", "cpu", "nvme") for o in ("gpu", "cpu", "nvme")]
    for zero in (0, 1, 2, 3):
        for p, o in pairs:
            if state_option_error(zero, p, o) is not None:
                continue
            whole = estimate_model_state_bytes(num_params=3000, zero_stage=zero, dp_degree=2, precision="fp32",
                                               param_tier=p, optimizer_tier=o, largest_block_params=1000,
                                               num_blocks=3, prefetch_depth=2, working_param_bytes=77)
            assert whole == estimate_stage_model_state_bytes(
                blocks=[(1000, p, o)] * 3, zero_stage=zero, dp_degree=2, precision="fp32", prefetch_depth=2,
                working_param_bytes=77), (zero, p, o)
    # ZeRO-1: the device block is sharded by FSDP2 beside a host block (16 bytes / d), not DDP + ZeRO
    mixed = estimate_stage_model_state_bytes(blocks=[(1000, "gpu", "gpu"), (1000, "cpu", "cpu")], zero_stage=1,
                                             dp_degree=2, precision="fp32")
    assert mixed.resident == 16 * 1000 / 2 and mixed.cpu == 16 * 1000 / 2
    # four disk-tier blocks share prefetch_depth + 2 = 3 staging buffers of the largest block's file bytes
    disk = estimate_stage_model_state_bytes(blocks=[(1000, "nvme", "nvme"), (500, "gpu", "nvme")] * 2,
                                            zero_stage=3, dp_degree=2, precision="fp32")
    assert disk.cpu == 3 * (4 + 8) * 1000 / 2
    assert disk.nvme_between_steps == ((4 + 8) * 2000 + 8 * 1000) / 2 and disk.nvme == 2 * disk.nvme_between_steps


def test_a_stage_disk_tier_has_one_prefetch_depth():
    """The disk tier of a stage is one staging pool read ahead by one depth: its nvme-parameter blocks
    with different prefetch depths are refused when the plan is made (blocks of a cpu parameter tier
    are prefetched by FSDP2, each by its own depth)."""
    from whalepy.ir.plan import BlockPlan, StagePlan

    def stage(*blocks: BlockPlan) -> StagePlan:
        return StagePlan(index=0, blocks=blocks, ranks=((0,),), device_types=("CPU",), zero_stage=3)

    stage(BlockPlan(name="a", param_tier="cpu", optimizer_tier="cpu", prefetch_depth=1),
          BlockPlan(name="b", param_tier="cpu", optimizer_tier="cpu", prefetch_depth=3),
          BlockPlan(name="c", param_tier="nvme", optimizer_tier="nvme", prefetch_depth=2))
    with pytest.raises(PlanError, match=r"stage 0: blocks with param_tier='nvme' have different prefetch depths "
                                        r"\(1: a; 2: c\)"):
        stage(BlockPlan(name="a", param_tier="nvme", optimizer_tier="cpu", prefetch_depth=1),
              BlockPlan(name="b", param_tier="gpu", optimizer_tier="nvme", prefetch_depth=3),
              BlockPlan(name="c", param_tier="nvme", optimizer_tier="nvme", prefetch_depth=2))
