"""The calls of a step as the cost model charges them: DDP's gradient all-reduce, one call per 25 MiB
bucket, not one per block; and the loss report, one all-reduce over every rank per step.

The runtime wraps a stage in ``DistributedDataParallel`` with the default bucket caps
(``runtime.data_parallel.wrap_ddp``); the reducer all-reduces each bucket in a call of its own. The
planner charged one call per block (gpt-deep of ``bench_predict_cpu.py``: ten calls of 1.2-2.1 ms on
gloo where DDP makes two), which put its DDP rows 20-26% slow. Here the calls DDP makes on 2 gloo ranks
(the buckets it rebuilds after the first step, as ``_get_ddp_logging_data`` reports them) are compared
with :func:`ddp_bucket_calls`, and the calls charged per step with the ones made. ``train_step`` ends
with an all-reduce of the mean loss on every rank, which the model did not charge: counted on a
pipeline step (no data parallelism, so it is the step's only collective) and charged once per step."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from whalepy.cost_models.communication import Collective, CommGroup, Link, estimate_collective_time
from whalepy.ir.rules import LoweringKind
from whalepy.planner.runtime_costs import (
    DDP_BUCKET_BYTES,
    DDP_EDGE_CALLS,
    DDP_FIRST_BUCKET_BYTES,
    build_dp_block_comm,
    ddp_bucket_calls,
    dp_edges,
    exposed_dp,
)

from dist_harness import run_distributed

WIDTH, LAYERS = 256, 110
"""110 linears of 256 x 256 (+ bias): 28.9 MB of fp32 gradients, over one 25 MiB bucket past the first
1 MiB one, so the count tests both caps (3 buckets); a small parameter each, so no bucket overflows
its cap by much."""


def test_bucket_caps_are_torchs_defaults() -> None:
    from torch.nn.parallel import distributed

    assert DDP_BUCKET_BYTES == distributed._DEFAULT_BUCKET_CAP_MB * 2**20
    assert DDP_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES


def _tiny_gpt():
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=16, num_layers=2, num_heads=2, hidden_size=32))
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, x


def _loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _pipeline_all_reduces(plan, cluster) -> int:
    import whalepy
    from whalepy.tools.comm_count import CollectiveCounter

    model, x = _tiny_gpt()
    pm = whalepy.parallelize(model, cluster, plan=plan, example_inputs=(x,), loss_fn=_loss,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=4)
    pm.train_step((x,), x)
    with CollectiveCounter() as counter:
        pm.train_step((x,), x)
    pm.close()
    return counter.calls[Collective.ALL_REDUCE]


def _rank(plan, cluster) -> tuple[list[int], int]:
    return _ddp_buckets(), _pipeline_all_reduces(plan, cluster)


def _ddp_buckets() -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh

    from whalepy.runtime.data_parallel import wrap_ddp

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ddp = wrap_ddp(model, init_device_mesh("cpu", (2,)))
    x = torch.randn(4, WIDTH)
    for _ in range(3):  # DDP rebuilds its buckets in the order of the first backward (second forward)
        ddp(x).sum().backward()
    sizes = ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    return [int(s) for s in str(sizes).split(",")]


def _cluster(call_us: float):
    from whalepy import ClusterSpec

    return ClusterSpec.from_dict({"groups": [{"name": "cpu", "gpu": "CPU", "gpus_per_node": 2, "cpu_memory_gb": 8,
                                              "intra_node": {"bandwidth_gbs": 1.0, "latency_us": 0,
                                                             "call_latency_us": call_us}}]})


@pytest.fixture(scope="module")
def estimates():
    import whalepy
    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

    model, x = _tiny_gpt()
    prof = whalepy.profile(model, (x,))
    layouts = {"PP2": dict(dp=1, pp=2, num_microbatches=2), "DP2": dict(dp=2)}
    return {(k, call): estimate_from_profile(prof, _cluster(call), ParallelConfig(**cfg), global_batch=4)
            for k, cfg in layouts.items() for call in (0.0, 2000.0)}


def test_a_step_is_charged_its_calls(estimates) -> None:
    """With a per-call cost only (2 ms) on top of a link, a pipeline step is charged the loss report's
    call and a call per message on its critical path: each of its ``M + S - 1`` micro-batch slots (2
    micro-batches, 2 stages) carries one send of the busiest stage; a DP step two more for DDP's buckets
    (the tiny GPT's gradients fit the first bucket and one more call is charged) plus their byte share,
    and the loss."""
    pp = estimates[("PP2", 2000.0)].step_time_s - estimates[("PP2", 0.0)].step_time_s
    slots = 2 + 2 - 1
    assert pp == pytest.approx(2e-3 * (1 + slots), rel=1e-6)
    dp = estimates[("DP2", 2000.0)].step_time_s - estimates[("DP2", 0.0)].step_time_s
    grads = estimates[("DP2", 0.0)].plan.stages[0].cost.params_bytes  # fp32 gradients, as many bytes
    assert dp == pytest.approx(2e-3 * (1 + DDP_EDGE_CALLS + grads / DDP_BUCKET_BYTES), rel=1e-3)


def test_calls_charged_are_the_buckets_ddp_all_reduces(estimates) -> None:
    buckets, reports = zip(*run_distributed(_rank, 2, estimates[("PP2", 0.0)].plan, _cluster(0.0), timeout=300))
    # a pipeline step (no replicas) all-reduces on every rank once: the loss report the model charges
    assert reports == (1, 1)
    buckets = buckets[0]
    nbytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    assert sum(buckets) == nbytes
    assert len(buckets) == ddp_bucket_calls(nbytes) == 3
    # the calls the planner charges a DDP stage of these blocks: the rows' share of the 25 MiB buckets
    # and the step's edge; a link with a per-call cost only shows the calls
    call = 1e-3
    group = CommGroup(ranks_per_node=2, num_nodes=1, intra=Link(bandwidth=1e30, latency=0.0), launch_latency=call,
                      inter=Link(bandwidth=1e30, latency=0.0))
    params = [float(WIDTH * WIDTH + WIDTH)] * LAYERS
    comm = build_dp_block_comm(estimate_collective_time, (), params, group, "fp32")
    assert comm.all_reduce_call == pytest.approx(call)
    rows = sum(exposed_dp(LoweringKind.DDP, False, False, 0.0, 1.0, comm, g, loss=1.0)[1] for g in range(LAYERS))
    edge = dp_edges(LoweringKind.DDP, False, False, comm, loss=1.0)[1]
    charged = (rows + edge) / call
    assert len(buckets) <= charged <= len(buckets) + 1, charged
    assert charged == pytest.approx(DDP_EDGE_CALLS + nbytes / DDP_BUCKET_BYTES, rel=1e-6)
    # the old rule, a call per block, charged 110 here
    assert LAYERS * estimate_collective_time(Collective.ALL_REDUCE, 4 * params[0], group) / call > 30 * charged
