"""The planner keeps activations in host memory where that beats recomputation and fits the node's host
memory, and recomputes (or does neither) otherwise; the ILP agrees with exhaustive enumeration."""

from __future__ import annotations

import pytest

from whalepy.cost_models.devices import CATALOG
from whalepy.cost_models.memory import BlockActivations, estimate_stage_activation_host_bytes
from whalepy.cost_models.offload import host_capacity_per_gpu
from whalepy.planner import plan_from_profile
from whalepy.planner.synthetic import transformer_profile

from planner_fixtures import cluster, group

FAST_LINK = 450e9
"""Host link per direction of NVLink-C2C (NVIDIA GH200: 900 GB/s CPU-GPU, both directions together):
copying a 4096-wide block's saved activations down and back up (on the compute stream, nothing hidden)
takes less time than recomputing its forward."""
SLOW_LINK = 16e9
"""PCIe 3.0 x16: the same copies take longer than the block's forward, so recomputing is cheaper."""
DEVICE_GIB = 20
"""An A100 with 20 GiB: the model states (16 GiB) fit, the activations of one 8-sample micro-batch do
not."""

PROF = transformer_profile(num_layers=4, hidden=4096, seq_len=1024, vocab=32000, num_heads=16, batch=1,
                           name="actoff")


def _plan(link: float, cpu_gb: float, *, allow: bool = True, solver: str = "highs"):  # type: ignore[no-untyped-def]
    dev = CATALOG["A100-80GB"].replace(name="a100-small", memory_bytes=DEVICE_GIB * 2**30,
                                       host_link_bandwidth=link)
    c = cluster(group("a", dev.name, 1, 1, custom={dev.name: dev}, cpu_gb=cpu_gb), custom=[dev])
    # one micro-batch: the memory cannot be won back with more micro-batches; no memory margin: the
    # device is sized so that the states fit beside the reserve alone (the test is of offload vs
    # recompute, not of headroom)
    return plan_from_profile(PROF, c, global_batch=8, max_microbatches=1, zero_stages=(0,), allow_offload=False,
                             allow_activation_offload=allow, solver=solver, memory_margin=0)


def _tiers(p) -> str:  # type: ignore[no-untyped-def]
    return "".join("A" if b.activation_offload else "C" if b.checkpoint else "-" for s in p.stages for b in s.blocks)


def _host_bytes(p) -> float:  # type: ignore[no-untyped-def]
    """The memory model's host bytes of the plan's offloaded blocks (one stage, one micro-batch)."""
    ratio = p.global_batch / p.num_microbatches / PROF.batch_size
    blocks = [BlockActivations(saved_bytes=pb.activation_bytes * ratio, input_bytes=pb.input_bytes * ratio,
                               offload=b.activation_offload)
              for b, pb in zip(p.stages[0].blocks, PROF.blocks)]
    return estimate_stage_activation_host_bytes(blocks=blocks, num_inflight=1)


def test_offload_chosen_where_cheaper_than_recompute_and_host_memory_holds_it() -> None:
    p = _plan(FAST_LINK, 512)
    without = _plan(FAST_LINK, 512, allow=False)
    assert "A" in _tiers(p) and "C" not in _tiers(p), _tiers(p)
    assert "C" in _tiers(without), _tiers(without)  # the memory is short: without offload it recomputes
    assert p.cost.step_time_s < without.cost.step_time_s * (1 - 1e-3), (p.cost.step_time_s, without.cost.step_time_s)
    st = p.stages[0].cost
    # the plan's host bytes are the memory model's for the offloaded blocks, within the node's host memory
    assert st.cpu_bytes == pytest.approx(_host_bytes(p), rel=1e-6)
    assert st.cpu_bytes <= host_capacity_per_gpu(512 * 2**30, 1)
    assert st.memory_bytes <= st.capacity_bytes
    # exhaustive enumeration of the same space finds the same optimum
    ex = _plan(FAST_LINK, 512, solver="exhaustive")
    assert ex.cost.step_time_s == pytest.approx(p.cost.step_time_s, rel=5e-3)
    assert ex.cost.step_time_s <= p.cost.step_time_s * (1 + 1e-9)


def test_recompute_wins_on_a_slow_host_link() -> None:
    p = _plan(SLOW_LINK, 512)
    assert "A" not in _tiers(p) and "C" in _tiers(p), _tiers(p)
    assert p.cost.step_time_s == pytest.approx(_plan(SLOW_LINK, 512, allow=False).cost.step_time_s, rel=1e-9)


def test_not_chosen_beyond_host_memory() -> None:
    # 1 GB of host memory holds not even one block's saved activations (1.6-1.8 GB here)
    p = _plan(FAST_LINK, 1)
    assert "A" not in _tiers(p) and "C" in _tiers(p), _tiers(p)
    assert p.stages[0].cost.cpu_bytes == 0
    # 4 GB holds one block's: the planner offloads what fits and recomputes the rest
    some = _plan(FAST_LINK, 4)
    assert _tiers(some).count("A") >= 1 and "C" in _tiers(some), _tiers(some)
    assert some.stages[0].cost.cpu_bytes <= host_capacity_per_gpu(4 * 2**30, 1)
    assert some.cost.step_time_s < p.cost.step_time_s
    ex = _plan(FAST_LINK, 4, solver="exhaustive")
    assert ex.cost.step_time_s == pytest.approx(some.cost.step_time_s, rel=5e-3)
