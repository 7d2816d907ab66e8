"""The planner keeps checkpointed inputs in host memory (``BlockPlan.checkpoint_offload``) only where the
device cannot hold them and the node's host memory can, as few as needed; the ILP agrees with exhaustive
enumeration; the plan's host bytes are the memory model's."""

from __future__ import annotations

import pytest

from whalepy.errors import InfeasibleError
from whalepy.cost_models.devices import CATALOG
from whalepy.cost_models.memory import BlockActivations, estimate_stage_activation_host_bytes
from whalepy.planner import plan_from_profile
from whalepy.planner.synthetic import transformer_profile

from planner_fixtures import cluster, group

PROF = transformer_profile(num_layers=14, hidden=1024, seq_len=1024, vocab=32000, num_heads=16, batch=1,
                           name="ckoff")
SHORT_GIB = 7.2
"""An A100 with 7.2 GiB: with every block checkpointed, the 16-sample micro-batch's checkpointed inputs
(32 MiB per block) do not all fit next to the model states and one block's recompute (they need
7.43 GiB in all; with some of them in host memory, 6.93 GiB suffice)."""
ROOMY_GIB = 7.6
"""... and with 7.6 GiB they do."""


def _plan(gib: float, *, allow: bool = True, cpu_gb: float = 512, solver: str = "highs"):  # type: ignore[no-untyped-def]
    dev = CATALOG["A100-80GB"].replace(name="a100-small", memory_bytes=int(gib * 2**30))
    c = cluster(group("a", dev.name, 1, 1, custom={dev.name: dev}, cpu_gb=cpu_gb), custom=[dev])
    # one micro-batch and no state offload: only the activations' placement can make it fit; no memory
    # margin: SHORT_GIB / ROOMY_GIB are sized against the usable memory the reserve alone leaves (the
    # test is of where checkpoints go, not of headroom)
    return plan_from_profile(PROF, c, global_batch=16, max_microbatches=1, zero_stages=(0,), allow_offload=False,
                             allow_activation_offload=False, allow_checkpoint_offload=allow, solver=solver,
                             memory_margin=0)


def _host_bytes(p) -> float:  # type: ignore[no-untyped-def]
    ratio = p.global_batch / p.num_microbatches / PROF.batch_size
    blocks = [BlockActivations(saved_bytes=pb.activation_bytes * ratio, input_bytes=pb.input_bytes * ratio,
                               checkpoint=b.checkpoint, checkpoint_offload=b.checkpoint_offload)
              for b, pb in zip(p.stages[0].blocks, PROF.blocks)]
    return estimate_stage_activation_host_bytes(blocks=blocks, num_inflight=1)


def test_checkpoints_go_to_the_host_only_where_the_device_is_short():
    with pytest.raises(InfeasibleError):
        _plan(SHORT_GIB, allow=False)
    p = _plan(SHORT_GIB)
    blocks = p.stages[0].blocks
    moved = sum(b.checkpoint_offload for b in blocks)
    assert all(b.checkpoint for b in blocks if b.checkpoint_offload) and 0 < moved < len(blocks), p
    st = p.stages[0].cost
    assert st.cpu_bytes == pytest.approx(_host_bytes(p), rel=1e-6) and st.cpu_bytes > 0
    assert st.memory_bytes <= st.capacity_bytes
    # exhaustive enumeration of the same space finds the same optimum
    ex = _plan(SHORT_GIB, solver="exhaustive")
    assert ex.cost.step_time_s == pytest.approx(p.cost.step_time_s, rel=5e-3)
    assert ex.cost.step_time_s <= p.cost.step_time_s * (1 + 1e-9)
    # the copies cost time: where the device holds the checkpoints, none goes to the host
    roomy = _plan(ROOMY_GIB)
    assert not any(b.checkpoint_offload for b in roomy.stages[0].blocks)
    assert roomy.cost.step_time_s < p.cost.step_time_s
    # and without host memory to hold them, nothing fits
    with pytest.raises(InfeasibleError):
        _plan(SHORT_GIB, cpu_gb=0.01)


def test_estimate_prices_a_fixed_checkpoint_offload():
    """``whalepy.estimate`` with ``checkpoint_offload=True``: every checkpointed input leaves the device
    for the host (the same evaluation the planner uses), the copies cost time, and the plan says so."""
    from whalepy.errors import PlanError
    from whalepy.planner.estimate import estimate_from_profile

    dev = CATALOG["A100-80GB"].replace(name="a100-small", memory_bytes=int(ROOMY_GIB * 2**30))
    c = cluster(group("a", dev.name, 1, 1, custom={dev.name: dev}, cpu_gb=512), custom=[dev])
    on, off = (estimate_from_profile(PROF, c, dict(dp=1, checkpoint=True, checkpoint_offload=k), global_batch=16)
               for k in (False, True))
    a, b = on.plan.stages[0].cost, off.plan.stages[0].cost
    inputs = 16 * sum(blk.input_bytes for blk in PROF.blocks)  # 16 samples, one micro-batch in flight
    assert b.cpu_bytes == pytest.approx(inputs, rel=1e-6) and a.cpu_bytes == 0
    assert a.activation_bytes - b.activation_bytes == pytest.approx(inputs, rel=1e-6)
    assert off.step_time_s > on.step_time_s
    assert all(blk.checkpoint_offload for blk in off.plan.stages[0].blocks)
    with pytest.raises(PlanError, match="set checkpoint too"):
        estimate_from_profile(PROF, c, dict(dp=1, checkpoint_offload=True), global_batch=16)
    bare = cluster(group("a", dev.name, 1, 1, custom={dev.name: dev}, cpu_gb=None), custom=[dev])
    with pytest.raises(PlanError, match="needs host memory"):
        estimate_from_profile(PROF, bare, dict(dp=1, checkpoint=True, checkpoint_offload=True), global_batch=16)
