"""Whale's promise end to end: plan for a mixed cluster, run the plan, compute what one process computes.

Four CPU ranks play a mixed cluster ("simulated" groups): two of a custom type 4x faster than the other
two. The types are far slower than real GPUs so that even this tiny model is compute-bound, which is
when Whale's balancing matters. The planner must give the faster replica the larger batch share; the
4-process run of that very plan must match the single-process model within 1e-5 after 3 AdamW steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import whalepy
from whalepy.models import GPT, GPTConfig

from dist_harness import run_distributed

pytestmark = pytest.mark.distributed

CLUSTER = {
    "network": {"bandwidth_gbps": 100},
    "devices": {
        "SimFast": {"peak_tflops_16": 0.4, "peak_tflops_32": 0.1, "memory_gb": 16, "memory_bandwidth_gbs": 100,
                    "host_link_gbs": 16, "vendor": "cpu", "source": "test: a slow simulated accelerator"},
        "SimSlow": {"peak_tflops_16": 0.1, "peak_tflops_32": 0.025, "memory_gb": 16, "memory_bandwidth_gbs": 25,
                    "host_link_gbs": 16, "vendor": "cpu", "source": "test: 4x slower than SimFast"},
    },
    "groups": [
        {"name": "fast", "gpu": "SimFast", "gpus_per_node": 2, "intra_node": "pcie4", "simulated": True},
        {"name": "slow", "gpu": "SimSlow", "gpus_per_node": 2, "intra_node": "pcie4", "simulated": True},
    ],
}
CFG = GPTConfig(vocab_size=128, block_size=16, num_layers=2, num_heads=4, hidden_size=64)
GLOBAL_BATCH = 20
STEPS = 3


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _example() -> tuple[torch.Tensor]:
    return (torch.zeros(2, CFG.block_size, dtype=torch.long),)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _adamw(params):  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size), generator=g) for _ in range(STEPS)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def _layout(plan: whalepy.Plan) -> tuple:
    return (plan.batch_shares, plan.num_microbatches, plan.schedule,
            [(s.ranks, s.block_names, s.zero_stage, s.device_types) for s in plan.stages], plan.tensor_parallel)


def _worker() -> dict:
    import torch.distributed as dist

    from runtime_cases import full_params

    cluster = whalepy.ClusterSpec.from_dict(CLUSTER)
    # No plan given: rank 0 plans and sends the plan to the others.
    pm = whalepy.parallelize(_model(), cluster, example_inputs=_example(), loss_fn=_loss, optimizer=_adamw,
                             global_batch=GLOBAL_BATCH, progress=False)
    losses = [float(pm.train_step(x, y)) for x, y in _data()]
    params = full_params(pm)
    ref_losses, ref_params = _reference()
    # Compared here: tensors sent back through the result queue would outlive the worker's fds.
    return {
        "rank": dist.get_rank(),
        "layout": _layout(pm.plan),
        "losses": losses,
        "ref_losses": ref_losses,
        "names": sorted(params),
        "ref_names": sorted(ref_params),
        "param_err": {n: float((params[n] - ref).abs().max()) for n, ref in ref_params.items() if n in params},
    }


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = _adamw(model.parameters())
    losses = []
    for x, y in _data():
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def mixed_plan() -> whalepy.Plan:
    cluster = whalepy.ClusterSpec.from_dict(CLUSTER)
    return whalepy.plan(_model(), cluster, example_inputs=_example(), global_batch=GLOBAL_BATCH, progress=False)


def test_planner_balances_batch_shares_by_device_speed(mixed_plan: whalepy.Plan) -> None:
    plan = mixed_plan
    share_by_type: dict[str, list[int]] = {}
    for d, share in enumerate(plan.batch_shares):
        share_by_type.setdefault(plan.stages[0].device_types[d], []).append(share)
    assert set(share_by_type) == {"SimFast", "SimSlow"}, plan
    assert min(share_by_type["SimFast"]) > max(share_by_type["SimSlow"]), plan
    assert sum(plan.batch_shares) == GLOBAL_BATCH


def test_parallelize_plans_once_runs_and_matches_one_process(mixed_plan: whalepy.Plan) -> None:
    results = run_distributed(_worker, mixed_plan.world_size, timeout=300)
    for r in results:
        assert r["layout"] == _layout(mixed_plan), r["rank"]
        assert len(r["losses"]) == STEPS
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (r["rank"], r["losses"], r["ref_losses"])
        assert r["names"] == r["ref_names"], r["rank"]
        worst = max(r["param_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, (r["rank"], worst)
