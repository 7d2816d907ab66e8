"""A training job, not a train step (issue 27), on 4 gloo processes sharing one process group:

- each rank reading only its share of the data (``pm.batch_sampler``; ``None`` for what its pipeline
  stage does not use) trains what every rank passing the global batch trains, for DP x PP and for
  uneven batch shares (fp32, 1e-5);
- a job killed between periodic checkpoints (asynchronous DCP saves, keep-last-1) and resumed from the
  newest, into a differently initialised model with a fresh loader and RNG, repeats the uninterrupted
  job's losses step for step (fp32, 1e-5), with dropout, a cosine LR schedule and torchdata's
  ``StatefulDataLoader``;
- the JSONL metrics sink's records parse and hold every field of the schema.
See tests/training_job_cases.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_harness import run_distributed
from training_job_cases import EVERY, KILLED_AT, STEPS, run_all

pytestmark = pytest.mark.distributed

RTOL = 1e-5


def test_per_rank_data_and_preempted_resume(tmp_path):
    from whalepy.runtime.metrics import FIELDS

    per_rank = run_distributed(run_all, 4, str(tmp_path), timeout=300)
    print("seconds per part (rank 0):", per_rank[0]["seconds"])
    for rank, out in enumerate(per_rank):
        for r in out["data"]:
            assert r["rows"] == r["share"], r["name"]  # the loader read this replica's rows only
            assert r["loss_err"] <= RTOL, (r["name"], r["losses"], r["ref"])
            assert r["param_err"] <= RTOL, (r["name"], r["param_err"])
        res = out["resume"]
        assert res["start"] == KILLED_AT // EVERY * EVERY  # the newest complete checkpoint
        assert res["kept"] == [f"step-{res['start']:08d}"]  # keep=1: older ones removed
        for got, want in zip(res["resumed"], res["straight"][res["start"]:], strict=True):
            assert abs(got - want) <= RTOL * abs(want), (res["resumed"], res["straight"])
        assert res["lrs"][0] == res["lrs"][1]  # the schedule went on from the checkpoint
    records = per_rank[0]["resume"]["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert set(r) == set(FIELDS), sorted(set(r) ^ set(FIELDS))
        for key in ("loss", "grad_norm", "lr", "step_s", "data_wait_s", "tokens_per_s", "peak_bytes",
                    "memory_share", "eta_s", "time"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
        assert r["loss_scale"] is None and r["skipped_steps"] == 0  # fp32
    # the logged LR is the cosine schedule's, step after step
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    want = []
    for _ in range(STEPS):
        opt.step()
        sched.step()
        want.append(sched.get_last_lr()[0])
    assert [r["lr"] for r in records] == pytest.approx(want, rel=1e-12)
    assert records[-1]["eta_s"] == 0.0 and records[0]["eta_s"] > 0


def test_sinks_check_their_package_before_any_work(monkeypatch, tmp_path):
    """A sink whose optional package is missing fails when it is built, in one line, before parallelize
    plans or lowers anything; a bad metrics / scheduler / total_steps argument too."""
    import sys

    import whalepy
    from whalepy.errors import ArgumentError, WhalepyError
    from whalepy.runtime.metrics import JsonlSink, TensorBoardSink, WandbSink

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(WhalepyError, match="pip install tensorboard"):
        TensorBoardSink(tmp_path / "tb")
    with pytest.raises(WhalepyError, match="pip install wandb"):
        WandbSink(project="x")
    model = torch.nn.Linear(4, 4)
    kw = dict(example_inputs=(torch.zeros(2, 4),), loss_fn=torch.nn.functional.mse_loss,
              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), global_batch=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad, word in (({"metrics": JsonlSink(tmp_path / "m.jsonl")}, "list of sinks"),
                      ({"metrics": [object()]}, "not a sink"),
                      ({"total_steps": 0}, "total_steps"),
                      ({"lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}, "factory")):
        with pytest.raises(ArgumentError, match=word):
            whalepy.parallelize(model, whalepy.ClusterSpec.local(2), **kw, **bad)


def test_sampler_is_the_global_order_split_by_shares():
    """The replicas' indices of each batch are consecutive pieces of one permutation per epoch, in
    replica order; the position resumes; another seed is refused on load."""
    from whalepy.errors import ArgumentError
    from whalepy.runtime.data import LocalShare, ShardedBatchSampler

    shares = (3, 1, 2, 2)
    samplers = [ShardedBatchSampler(20, LocalShare(replica=r, num_replicas=4, start=sum(shares[:r]), size=n,
                                                   global_batch=8, needs_inputs=True, needs_targets=True), seed=4)
                for r, n in enumerate(shares)]
    epochs = [[b for _ in range(2) for b in s] for s in samplers]  # 2 epochs of 2 batches (4 samples dropped)
    for step in range(4):
        joined = [i for e in epochs for i in e[step]]
        perm = torch.randperm(20, generator=torch.Generator().manual_seed(4 + step // 2)).tolist()
        assert joined == perm[(step % 2) * 8:(step % 2 + 1) * 8]
    s = samplers[2]
    again = ShardedBatchSampler(20, s.share, seed=4)
    it = iter(s)
    next(it)
    again.load_state_dict(s.state_dict())
    assert next(iter(again)) == next(it)
    with pytest.raises(ArgumentError, match="seed"):
        ShardedBatchSampler(20, s.share, seed=5).load_state_dict(s.state_dict())
