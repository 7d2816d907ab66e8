"""``whalepy study zero --measure``: train each configuration of the study for a few steps on CPU gloo
processes and record, per rank, the model-state bytes it holds and the collective bytes its process
group carries, next to the prediction.

Each row's plan is the one :func:`whalepy.estimate_from_profile` made for the prediction, lowered by
:func:`whalepy.parallelize` as any training run is. In the last step:

- held bytes: at the optimizer step (parameters, gradients and the optimizer states of earlier steps all
  alive), the storages of this rank's parameters (FSDP2's padded local shards), of their gradients
  (DDP's bucket views) and of the optimizer's tensor states (not the 0-dim ``step`` counters), each
  storage once; "host" for those FSDP2 offloads (``CPUOffloadPolicy``), "device" for the rest;
- communication: the payload of every collective of the step, counted at the process group by
  :class:`whalepy.tools.comm_count.CollectiveCounter` (FSDP2's all-gathers and reduce-scatters, DDP's
  bucket all-reduces, ZeroRedundancyOptimizer's broadcasts).

The first steps are not counted: FSDP2 initialises lazily in the first, DDP rebuilds its buckets
(a small broadcast) in the second. The loss is the mean square of the model's output: what a step
holds and sends does not depend on the loss.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from typing import Any

from whalepy.errors import WhalepyError
from whalepy.hardware.cluster import ClusterSpec
from whalepy.ir.profile import ModelProfile

__all__ = ["check_measurable", "held_state_bytes", "measure_rows"]

MEASURE_TIMEOUT_S = 900.0
"""Longest a measurement may take before its processes are killed."""


def check_measurable(cluster: ClusterSpec, models: list[Any]) -> None:
    """Refuse, before anything is profiled, a model the ranks cannot build (a profile, ``synthetic:``)
    and a cluster whose ranks are not CPU processes: the counter is thread-local (on CUDA the
    backward's collectives run on the autograd device thread) and the study spawns the ranks itself."""
    for spec in models:
        if not isinstance(spec, str) or spec.startswith("synthetic:"):
            raise WhalepyError(f"--measure needs a model to train (built-in name or package.module:function), "
                               f"not {spec if isinstance(spec, str) else 'a profile'}: the ranks build it "
                               "themselves")
    gpus = [g.name for g in cluster.groups if g.device.vendor != "cpu" and not g.simulated]
    if gpus:
        raise WhalepyError(f"--measure trains on CPU gloo processes, but group(s) {', '.join(gpus)} are GPUs; "
                           "use a CPU cluster (examples/clusters/cpu4.yaml) or mark the group simulated: true")
    if cluster.world_size > (os.cpu_count() or 1) * 4:
        raise WhalepyError(f"--measure would start {cluster.world_size} processes on {os.cpu_count()} CPU cores; "
                           "use a cluster of at most a few ranks per core")


def available_host_bytes() -> int:
    """Host memory free for new processes: ``MemAvailable`` of /proc/meminfo, else the physical total."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_host_memory(spec: str, rows: list[Any], world: int) -> None:
    """Refuse before a process starts what the ranks' host memory cannot hold: each rank builds the
    whole model in fp32 (4 bytes a parameter) and then holds its row's predicted peak (the largest
    row); the processes share one host. Without this a too-large model swaps or hangs."""
    per_rank = 4 * rows[0].num_params + max(r.peak_bytes for r in rows)
    free = available_host_bytes()
    if world * per_rank > free:
        raise WhalepyError(f"--measure of {spec}: {world} ranks x {per_rank / 2**30:.1f} GiB (the fp32 model each "
                           f"builds + its predicted peak) = {world * per_rank / 2**30:.1f} GiB, but this host has "
                           f"{free / 2**30:.1f} GiB available; measure a smaller model or configuration "
                           "(e.g. gpt2), or leave --measure out for the prediction alone")


def held_state_bytes(pm: Any) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states this rank holds: ``{"device", "host"}``
    (:func:`whalepy.runtime.held.held_state_bytes` summed over kinds; the study has no disk tier)."""
    from whalepy.runtime.held import held_state_bytes as by_kind

    held = by_kind(pm)
    return {place: sum(held[k][place] for k in held) for place in ("device", "host")}


def _rank_measure(spec: str, prof: ModelProfile, cluster: ClusterSpec, cases: list[tuple[int, str | None]], *,
                  seq_len: int | None, steps: int, global_batch: int, precision: str | None,
                  num_microbatches: int, checkpoint: bool) -> list[dict[str, Any]]:
    import torch

    from whalepy.tools.comm_count import CollectiveCounter
    from whalepy.tools.model_arg import load_model
    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile
    from whalepy.runtime import parallelize
    from whalepy.runtime.materialize import has_meta_tensors, materialize

    torch.manual_seed(0)
    _, example = load_model(spec, batch=1, seq_len=seq_len)
    example = example if isinstance(example, tuple) else (example,)
    data = [tuple(torch.randint(0, 2, (global_batch, *x.shape[1:])) if not x.is_floating_point()
                  else torch.randn(global_batch, *x.shape[1:]) for x in example) for _ in range(steps)]
    targets = torch.zeros(global_batch)
    out = []
    for zero, off in cases:
        cfg = ParallelConfig(dp=cluster.world_size, zero_stage=zero, offload=off, num_microbatches=num_microbatches,
                             checkpoint=checkpoint)
        plan = estimate_from_profile(prof, cluster, cfg, global_batch=global_batch, precision=precision).plan
        model, _ = load_model(spec, batch=1, seq_len=seq_len)
        if has_meta_tensors(model):  # DDP checks parameter shapes with real tensors before lowering
            materialize(model, "cpu", seed=0)
        pm = parallelize(model, cluster, example_inputs=tuple(x[:1] for x in data[0]),
                         loss_fn=lambda y, _t: y.float().pow(2).mean(),
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), global_batch=global_batch,
                         plan=plan, profile=prof)
        held: list[dict[str, int]] = []
        step = pm.optimizer.step

        def measured_step(*a: Any, _step: Any = step, _pm: Any = pm, **k: Any) -> Any:
            held.append(held_state_bytes(_pm))
            return _step(*a, **k)

        pm.optimizer.step = measured_step
        counter = CollectiveCounter()
        for i, x in enumerate(data):
            counter.reset()
            if i == len(data) - 1:
                with counter:
                    pm.train_step(x, targets)
            else:
                pm.train_step(x, targets)
        out.append({"case": (zero, off), "held": held[-1], "payload": {c.value: float(n) for c, n in
                                                                        counter.bytes.items()}})
    return out


def _worker(rank: int, world: int, store_path: str, args: tuple, kwargs: dict, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        try:
            results.put((rank, True, _rank_measure(*args, **kwargs)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports any rank's failure with its traceback
        results.put((rank, False, traceback.format_exc()))


def measure_rows(spec: Any, prof: ModelProfile, cluster: ClusterSpec, rows: list[Any], *, seq_len: int | None,
                 steps: int, precision: str | None, num_microbatches: int, checkpoint: bool) -> list[Any]:
    """``rows`` (one model's :class:`~whalepy.tools.study.ZeroStudyRow`) with ``measured_*`` filled in: the
    largest held device (or, offloaded, host) bytes and the largest payload over the ranks."""
    check_measurable(cluster, [spec])
    if steps < 3:
        raise WhalepyError(f"--measure needs at least 3 steps (the first two initialise), got {steps}")
    world = cluster.world_size
    _check_host_memory(spec, rows, world)
    cases = [(r.zero_stage, r.offload) for r in rows]
    args = (spec, dataclasses.replace(prof, graph=None), cluster, cases)
    kwargs = dict(seq_len=seq_len, steps=steps, global_batch=rows[0].global_batch, precision=precision,
                  num_microbatches=num_microbatches, checkpoint=checkpoint)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    got: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="whalepy-study-") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), args, kwargs, results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        try:
            while len(got) < world:
                try:
                    rank, ok, value = results.get(timeout=MEASURE_TIMEOUT_S)
                except queue.Empty:
                    raise WhalepyError(f"--measure: ranks {sorted(set(range(world)) - set(got))} did not finish "
                                       f"within {MEASURE_TIMEOUT_S:.0f} s") from None
                if not ok:
                    raise WhalepyError(f"--measure: rank {rank} failed:\n{value}")
                got[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    out = []
    for i, row in enumerate(rows):
        per_rank = [got[r][i] for r in range(world)]
        place = "host" if row.offload else "device"
        kinds = {k for m in per_rank for k in m["payload"]}
        out.append(dataclasses.replace(
            row, measured_state_bytes=float(max(m["held"][place] for m in per_rank)),
            measured_payload_bytes={k: max(m["payload"].get(k, 0.0) for m in per_rank) for k in sorted(kinds)}))
    return out
