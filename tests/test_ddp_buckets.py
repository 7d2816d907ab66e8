"""DDP's gradient all-reduce as the cost model charges it: one call per 25 MiB bucket, not one per block.

The runtime wraps a stage in ``DistributedDataParallel`` with the default bucket caps
(``runtime.data_parallel.wrap_ddp``); the reducer all-reduces each bucket in a call of its own. The
planner charged one call per block (gpt-deep of ``bench_predict_cpu.py``: ten calls of 1.2-2.1 ms on
gloo where DDP makes two), which put its DDP rows 20-26% slow. Here the calls DDP makes on 2 gloo ranks
(the buckets it rebuilds after the first step, as ``_get_ddp_logging_data`` reports them) are compared
with :func:`ddp_bucket_calls`, and the calls charged per step with the ones made."""
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


def test_calls_charged_are_the_buckets_ddp_all_reduces() -> None:
    buckets = run_distributed(_ddp_buckets, 2, timeout=300)[0]
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
