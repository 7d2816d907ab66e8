"""Per-rank workers for tests/test_training_job.py (no tests here): each rank reading only its share of
the data, against every rank passing global batches; and a preempted job resumed from its last
periodic checkpoint, against the same job uninterrupted.

Data: a ``TensorDataset`` of token sequences read through ``pm.batch_sampler`` (shuffled, several
epochs) in a plain ``DataLoader``; ranks pass ``None`` for what their pipeline stage does not use. The
global-batch run reads the same global batches (the sampler of a share covering the whole batch) and
passes them whole. Both must give the same losses and weights (fp32, 1e-5).

Resume: a GPT with dropout (so the RNG states matter), a cosine LR schedule given as a factory, the
data through torchdata's ``StatefulDataLoader`` over ``pm.batch_sampler`` (epochs of 3 steps), metrics
to a JSONL file. The uninterrupted job trains :data:`STEPS` steps, checkpointing every 2 steps with ``keep=1``
and asynchronous saves; what its checkpoint directory holds after step 5 (what a job killed then
leaves: step 4) is copied aside, and a fresh ``parallelize`` of a differently initialised model, with
a fresh loader and a disturbed RNG, resumes from it and trains to the end.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from runtime_cases import (Case, SEQ, VOCAB, adamw, build_model, case_profile, full_params, lm_loss, make_case_plan,
                           train_single)

GLOBAL_BATCH = 8
STEPS = 7
EVERY = 2
KILLED_AT = 5


def _dataset(num_samples: int, seed: int = 3) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_samples, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _parallelize(case: Case, model: torch.nn.Module, **kw: Any) -> Any:
    from whalepy.runtime import parallelize

    return parallelize(model, None, example_inputs=(torch.zeros(2, SEQ, dtype=torch.long),), loss_fn=lm_loss,
                       optimizer=adamw, global_batch=case.global_batch, plan=make_case_plan(case),
                       profile=case_profile(case.kind, case.num_layers), **kw)


def _per_rank_vs_global(case: Case) -> dict[str, Any]:
    """Train from per-rank reads; the same global batches in one process (the global-batch path equals
    it: tests/test_runtime_parallel.py)."""
    from whalepy.runtime.data import LocalShare, ShardedBatchSampler

    data = _dataset(3 * case.global_batch)  # 3 steps per epoch: the run crosses an epoch
    pm = _parallelize(case, build_model(case.kind))
    share = pm.local_share
    loader = torch.utils.data.DataLoader(data, batch_sampler=pm.batch_sampler(data, seed=5))
    whole = ShardedBatchSampler(len(data), LocalShare(replica=0, num_replicas=1, start=0, size=case.global_batch,
                                                      global_batch=case.global_batch, needs_inputs=True,
                                                      needs_targets=True), seed=5)
    global_batches = [data[idx] for _ in range(2) for idx in whole][:case.steps]
    local, it = [], iter(loader)
    for _ in range(case.steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        rows = x.shape[0]
        local.append(pm.train_step(x if share.needs_inputs else None, y if share.needs_targets else None).item())
    ref, ref_params = train_single(build_model(case.kind), global_batches)
    got = full_params(pm)
    return {"name": case.name, "rows": rows, "share": share.size, "losses": local, "ref": ref,
            "loss_err": max(abs(p - q) / abs(q) for p, q in zip(local, ref)),
            "param_err": max((got[k] - ref_params[k]).abs().max().item() for k in got)}


def _job(case: Case, *, metrics: list[Any] = (), scrambled: bool = False) -> tuple[Any, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    model = build_model(case.kind)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    if scrambled:
        torch.manual_seed(123)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    torch.manual_seed(1000 + int(os.environ["RANK"]) + (77 if scrambled else 0))  # dropout masks per rank
    pm = _parallelize(case, model, log_every=1, total_steps=STEPS, metrics=list(metrics),
                      lr_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS))
    data = _dataset(3 * case.global_batch)
    # a generator of its own: an iterator's creation draws a seed from it, not from the global RNG
    # (whose state the checkpoint restores, and which dropout consumes)
    loader = StatefulDataLoader(data, batch_sampler=pm.batch_sampler(data, seed=9), generator=torch.Generator())
    return pm, loader


def _preempt_and_resume(case: Case, root: str) -> dict[str, Any]:
    """The uninterrupted job checkpoints as it goes; what its directory holds after step
    :data:`KILLED_AT` is what a job killed then leaves (copied aside), and the resumed job starts
    from that copy. So checkpointing must not change the run either."""
    import shutil

    import torch.distributed as dist

    from whalepy.runtime import Checkpointer
    from whalepy.runtime.metrics import JsonlSink

    jsonl = os.path.join(root, "metrics.jsonl")
    ckdir, killed = os.path.join(root, "ckpt"), os.path.join(root, "ckpt-at-kill")
    pm, loader = _job(case, metrics=[JsonlSink(jsonl)])
    ckpt = Checkpointer(pm, ckdir, every=EVERY, keep=1, loader=loader, async_save=True)
    it = _batches(loader)
    straight = []
    for _ in range(KILLED_AT):
        straight.append(pm.train_step(*next(it)).item())
        ckpt.step()
    ckpt.close()  # the save of step 4 is complete: what the killed job leaves
    kept = sorted(os.listdir(ckdir))
    if dist.get_rank() == 0:
        shutil.copytree(ckdir, killed)
    dist.barrier()
    for _ in range(STEPS - KILLED_AT):
        straight.append(pm.train_step(*next(it)).item())
        ckpt.step()
    ckpt.close()
    lrs = [pm.lr_schedulers[0].get_last_lr()[0]]
    pm.close()

    pm, loader = _job(case, scrambled=True)
    ckpt = Checkpointer(pm, killed, every=EVERY, keep=1, loader=loader)
    start = ckpt.resume()
    it = _batches(loader)
    resumed = [pm.train_step(*next(it)).item() for _ in range(STEPS - start)]
    lrs.append(pm.lr_schedulers[0].get_last_lr()[0])
    records = []
    if dist.get_rank() == 0:
        with open(jsonl, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
    return {"name": case.name, "straight": straight, "resumed": resumed, "start": start,
            "kept": kept, "lrs": lrs, "records": records}


def _batches(loader: Any) -> Any:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def run_all(root: str) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", message=".*'set_vital' is deprecated.*")  # torchdata 0.11 on torch >= 2.9
    data_cases = [Case("pp2 x dp2, 2 micro-batches", pp=2, dp=2, microbatches=2, steps=4),
                  Case("dp4 mixed shares (3, 3, 1, 1)", dp=4, shares=(3, 3, 1, 1), zero=2, steps=4)]
    import time

    t = time.perf_counter()
    out: dict[str, Any] = {"data": [_per_rank_vs_global(c) for c in data_cases]}
    t1 = time.perf_counter()
    out["resume"] = _preempt_and_resume(Case("pp2 x dp2 resume", pp=2, dp=2, microbatches=2), root)
    out["seconds"] = {"data": t1 - t, "resume": time.perf_counter() - t1}
    out["cosine_ok"] = math.isfinite(out["resume"]["lrs"][0])
    return out
