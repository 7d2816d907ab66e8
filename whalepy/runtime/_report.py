"""What a training run tells its user: the plan it lowers and, every N steps, how it is doing.

- :func:`plan_log_lines`: the plan :func:`~whalepy.parallelize` lowers, a head line and one line per
  pipeline stage (logged on rank 0).
- :class:`StepReporter`: step, loss, step time, tokens/s, MFU and peak memory every ``log_every``
  steps, next to what the plan predicted; a ``rich`` progress line when ``rich`` is installed and
  stderr is a terminal.

Measured MFU is the plan's: the same model FLOPs and peak (``plan.cost.mfu`` at the predicted step
time), so ``MFU = plan MFU x predicted step time / measured step time``. Peak memory is the largest
over all ranks: the CUDA caching allocator's peak of allocated bytes on GPUs, the process's peak
resident set on CPU (which also counts the interpreter and libraries, so it is not comparable with the
plan's per-device estimate and the prediction is not shown next to it).
"""

from __future__ import annotations

import resource
import sys
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from whalepy.log import is_rank0, logger
from whalepy.ir.plan_text import block_tiers, compress_names, compress_ranks
from whalepy.ir.plan import Plan, Tier

__all__ = ["StepReporter", "plan_log_lines"]

GIB = 1 << 30


def _secs(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


def plan_log_lines(plan: Plan) -> list[str]:
    """A head line (degrees, schedule, batch, precision, predicted step time) and one line per stage."""
    types = Counter(plan.rank_device_types)
    c = plan.cost
    pred = f", predicted {_secs(c.step_time_s)}/step, MFU {100 * c.mfu:.1f}%" if c.step_time_s > 0 else ""
    lines = [f"whalepy: lowering a plan for {plan.model_name} on {plan.world_size} devices "
             f"({', '.join(f'{n} x{k}' for n, k in types.items())}): pp={plan.pp_degree} dp={plan.dp_degree} "
             f"tp={'/'.join(map(str, sorted(set(plan.tp_degrees))))}, {plan.schedule.value}"
             + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
             + f", {plan.num_microbatches} micro-batches of global batch {plan.global_batch}, "
             f"{plan.precision.value}{pred}"]
    for s in plan.stages:
        # each run of blocks with its (parameter / optimizer) tiers: blocks of one stage may differ
        offloaded = any(Tier.GPU is not t for b in s.blocks for t in (b.param_tier, b.optimizer_tier))
        tiers = [f"tiers {block_tiers(s)}"] if offloaded else []
        ck = sum(b.checkpoint for b in s.blocks)
        mem = (f", memory {_bytes(s.cost.memory_bytes)} of {_bytes(s.cost.capacity_bytes)}"
               if s.cost.capacity_bytes else "")
        lines.append(f"whalepy:   stage {s.index}: {compress_names(s.block_names)} on ranks "
                     f"[{compress_ranks(s.all_ranks)}] ({', '.join(sorted(set(s.device_types)))}), "
                     f"tp {s.tp_degree} x dp {s.dp_degree}, ZeRO-{int(s.zero_stage)}, "
                     f"recompute {ck}/{len(s.blocks)} blocks" + "".join(f", {t}" for t in tiers) + mem)
    return lines


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepReporter:
    """Times :meth:`~whalepy.ParallelModel.train_step` and reports every ``log_every`` steps.

    Every rank calls :meth:`step_done` after each step (the report's peak memory is a collective); the
    device is synchronised only at report steps, and the step time is the mean over the steps since
    the last report."""

    def __init__(self, plan: Plan, device: torch.device, log_every: int | None, *,
                 progress: bool | None = None) -> None:
        self.plan = plan
        self.device = device
        self.log_every = log_every
        self.steps = 0
        self._window_start: float | None = None
        self._window_steps = 0
        self.last: dict[str, float] = {}
        self._progress: Any = None
        want = progress if progress is not None else sys.stderr.isatty()
        if log_every is not None and want and is_rank0():
            self._progress = _rich_progress()

    def step_started(self) -> None:
        if self._window_start is None:
            _synchronize(self.device)
            self._window_start = time.perf_counter()

    def step_done(self, loss: torch.Tensor, tokens: int | None) -> None:
        self.steps += 1
        self._window_steps += 1
        if self._progress is not None:
            self._progress[0].update(self._progress[1], advance=1)
        if self.log_every is None or self.steps % self.log_every:
            return
        _synchronize(self.device)
        now = time.perf_counter()
        step_s = (now - (self._window_start or now)) / max(self._window_steps, 1)
        self._window_start, self._window_steps = now, 0
        peak = torch.tensor([float(_peak_bytes(self.device))], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        c = self.plan.cost
        rec = {"step": float(self.steps), "loss": float(loss.item()), "step_s": step_s,
               "peak_bytes": float(peak.item())}
        if tokens:
            rec["tokens_per_s"] = tokens / step_s if step_s > 0 else 0.0
        if c.mfu > 0 and c.step_time_s > 0 and step_s > 0:
            rec["mfu"] = c.mfu * c.step_time_s / step_s
        self.last = rec
        if is_rank0():
            line = self.format(rec)
            if self._progress is not None:
                self._progress[0].update(self._progress[1], description=line)
            logger.info("%s", line)

    def format(self, rec: dict[str, float]) -> str:
        c = self.plan.cost
        parts = [f"whalepy: step {int(rec['step'])}", f"loss {rec['loss']:.4f}",
                 f"{_secs(rec['step_s'])}/step" + (f" (plan {_secs(c.step_time_s)})" if c.step_time_s > 0 else "")]
        if "tokens_per_s" in rec:
            parts.append(f"{rec['tokens_per_s']:,.0f} tokens/s")
        if "mfu" in rec:
            parts.append(f"MFU {100 * rec['mfu']:.1f}%")
        if self.device.type == "cuda":
            plan_peak = max((s.cost.memory_bytes for s in self.plan.stages), default=0)
            parts.append(f"peak {_bytes(rec['peak_bytes'])}" + (f" (plan {_bytes(plan_peak)})" if plan_peak else ""))
        else:
            parts.append(f"peak RSS {_bytes(rec['peak_bytes'])}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._progress is not None:
            self._progress[0].stop()
            self._progress = None


def _rich_progress() -> Any:
    try:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    import atexit

    progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.completed}[/] steps"), TimeElapsedColumn(),
                        TextColumn("{task.description}"), transient=False)
    task = progress.add_task("whalepy: training", total=None)
    progress.start()
    atexit.register(progress.stop)
    return progress, task
