"""What a training run tells its user: the plan it lowers and, every N steps, how it is doing.

- :func:`plan_log_lines`: the plan :func:`~whalepy.parallelize` lowers, a head line and one line per
  pipeline stage (logged on rank 0).
- :class:`StepReporter`: step, loss, step time, tokens/s, MFU and peak memory every ``log_every``
  steps, next to what the plan predicted; a ``rich`` progress line when ``rich`` is installed and
  stderr is a terminal.

- the plan check (closed loop): after :data:`PLAN_CHECK_WARMUP` warm-up steps, the next
  :data:`PLAN_CHECK_STEPS` steps are timed (device synchronised at both ends, the slowest rank's) and,
  on a GPU, the allocator's peak is read; the ratios to the plan's predictions are logged once on rank
  0, with a warning when the step time is more than :data:`OFF_PLAN_TOLERANCE` off. The step after
  them, :data:`SAMPLED_STEP`, runs with per-block timing hooks (:mod:`whalepy.runtime._block_timing`):
  per stage its compute, optimizer step and the rest are logged once next to the plan's, and
  :meth:`~whalepy.ParallelModel.measured_profile` returns the profile with the block times merged in
  (:attr:`~whalepy.ParallelModel.observed`: the :class:`ObservedStep` with them).
- compiled blocks (``plan.compile``): the first step compiles them; its time is logged once on rank 0,
  apart, and the reported step times start after it (:attr:`StepReporter.first_step_s`).

Measured MFU is the plan's: the same model FLOPs and peak (``plan.cost.mfu`` at the predicted step
time), so ``MFU = plan MFU x predicted step time / measured step time``. Peak memory is the largest
over all ranks: the CUDA caching allocator's peak of allocated bytes on GPUs, the process's peak
resident set on CPU (which also counts the interpreter and libraries, so it is not comparable with the
plan's per-device estimate and the prediction is not shown next to it).
"""

from __future__ import annotations

import itertools
import os
import resource
import sys
from collections.abc import Sequence
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from whalepy.log import info_once, is_rank0, logger, warn_once
from whalepy.ir.plan_text import block_tiers, compress_names, compress_ranks, stage_lowering
from whalepy.ir.plan import Plan, Tier
from whalepy.runtime._block_timing import BlockTimer, StepTiming, build_step_timing, gather_records

__all__ = ["ObservedStep", "StepReporter", "plan_log_lines"]

GIB = 1 << 30

PLAN_CHECK_WARMUP = 2
"""Steps before the plan check starts timing: the first steps allocate the optimizer states, build the
communicators and warm the allocator's caches, and are slower than the steady state the plan predicts."""

PLAN_CHECK_STEPS = 3
"""Steps the plan check times (a mean, so one noisy step does not decide)."""

OFF_PLAN_TOLERANCE = 0.15
"""Relative step-time difference from the plan above which the plan check warns (issue 21: a plan that
runs more than 15% off its prediction says so, once)."""

_SERIAL = itertools.count()
"""Numbers the reporters of a process: the keys of their once-only lines (an ``id`` may be reused)."""

SAMPLED_STEP = PLAN_CHECK_WARMUP + PLAN_CHECK_STEPS + 1
"""The step timed per block (after the plan check, so that the hooks' cost stays out of its times)."""


@dataclass(frozen=True, kw_only=True)
class ObservedStep:
    """What the plan check measured against what the plan predicted."""

    steps: int
    """Steps timed (after the warm-up)."""
    step_s: float
    """Mean step time, the slowest rank's."""
    predicted_step_s: float
    peak_bytes: int | None
    """Largest allocator peak over the ranks (GPU); None on CPU, whose resident set is no tensor peak."""
    predicted_peak_bytes: int
    """The plan's largest per-device memory."""
    timing: StepTiming | None = None
    """Per block and per stage, what step :data:`SAMPLED_STEP` measured (None until it ran)."""

    @property
    def step_ratio(self) -> float:
        """Measured / predicted step time."""
        return self.step_s / self.predicted_step_s if self.predicted_step_s > 0 else float("inf")

    @property
    def memory_ratio(self) -> float | None:
        if self.peak_bytes is None or self.predicted_peak_bytes <= 0:
            return None
        return self.peak_bytes / self.predicted_peak_bytes


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
                     f"tp {s.tp_degree} x dp {s.dp_degree}, {stage_lowering(plan, s)}, "
                     f"recompute {ck}/{len(s.blocks)} blocks" + "".join(f", {t}" for t in tiers) + mem)
    return lines


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def _capacity_bytes(device: torch.device) -> int:
    """The memory a peak is a share of: the GPU's, or the host's RAM (CPU ranks share it)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _eta(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepReporter:
    """Times :meth:`~whalepy.ParallelModel.train_step` and reports every ``log_every`` steps.

    Every rank calls :meth:`step_done` after each step (the report's peak memory is a collective); the
    device is synchronised only at report steps, and the step time is the mean over the steps since
    the last report."""

    def __init__(self, plan: Plan, device: torch.device, log_every: int | None, *,
                 progress: bool | None = None, sinks: Sequence[Any] = (), total_steps: int | None = None,
                 timer: BlockTimer | None = None) -> None:
        self.plan = plan
        self.device = device
        self.log_every = log_every
        self.steps = 0
        self._window_start: float | None = None
        self._window_steps = 0
        self.last: dict[str, Any] = {}
        """The last report's record (:data:`whalepy.runtime.metrics.FIELDS`)."""
        self.sinks = list(sinks)
        self.total_steps = total_steps
        self.skipped_steps = 0
        self._last_end: float | None = None
        self._data_wait = 0.0
        self.last: dict[str, float] = {}
        self.observed: ObservedStep | None = None
        self._check_start: float | None = None
        self._progress: Any = None
        self.first_step_s: float | None = None
        """Wall seconds of the first step when the plan compiles its blocks (compile included)."""
        self.timer = timer
        self._serial = next(_SERIAL)
        self.timing: StepTiming | None = None
        """What the sampled step measured (also in :attr:`observed`)."""
        want = progress if progress is not None else sys.stderr.isatty()
        if log_every is not None and want and is_rank0():
            self._progress = _rich_progress()

    def not_waiting_for_data(self) -> None:
        """Time since the last step went elsewhere (a checkpoint save): not counted as data wait."""
        if self._last_end is not None:
            self._last_end = time.perf_counter()

    def reports_next(self) -> bool:
        """Whether the step about to finish is a report step."""
        return self.log_every is not None and (self.steps + 1) % self.log_every == 0

    def step_started(self) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._data_wait += now - self._last_end  # between steps: the loader (and user code)
        if self.steps == PLAN_CHECK_WARMUP and self._check_start is None:
            _synchronize(self.device)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self._check_start = time.perf_counter()
        if self._window_start is None:
            _synchronize(self.device)
            self._window_start = time.perf_counter()
        if self.timer is not None and self.steps == SAMPLED_STEP - 1:
            self.timer.start()

    def step_done(self, loss: torch.Tensor, tokens: int | None, extra: dict[str, Any] | None = None) -> None:
        extra = extra or {}
        self.steps += 1
        self._window_steps += 1
        self.skipped_steps += bool(extra.get("skipped"))
        if self.steps == 1 and self.plan.compile:
            self._first_step_apart()
        if self.steps == PLAN_CHECK_WARMUP + PLAN_CHECK_STEPS and self._check_start is not None:
            self._check_plan()
        if self.timer is not None and self.timer.active:
            self._sampled_step()
        if self._progress is not None:
            self._progress[0].update(self._progress[1], advance=1)
        if self.log_every is None or self.steps % self.log_every:
            self._last_end = time.perf_counter()
            return
        _synchronize(self.device)
        now = time.perf_counter()
        step_s = (now - (self._window_start or now)) / max(self._window_steps, 1)
        data_wait_s = self._data_wait / max(self._window_steps, 1)
        self._window_start, self._window_steps, self._data_wait = now, 0, 0.0
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
        self.last = self._record(rec, extra, data_wait_s)
        if is_rank0():
            line = self.format(rec)
            if self._progress is not None:
                self._progress[0].update(self._progress[1], description=line)
            logger.info("%s", line)
            for sink in self.sinks:
                sink.write(self.last)
        self._last_end = time.perf_counter()

    def _first_step_apart(self) -> None:
        """The first step of a plan with compiled blocks compiles them: logged apart, and left out of
        the step times reported (unless it is itself a report step, ``log_every=1``)."""
        _synchronize(self.device)
        now = time.perf_counter()
        self.first_step_s = now - (self._window_start or now)
        info_once("compile-first-step", "whalepy: first step %.2f s, compiling the blocks (torch.compile); "
                  "the step times reported leave it out", self.first_step_s)
        if not (self.log_every is not None and self.steps % self.log_every == 0):
            self._window_start, self._window_steps, self._data_wait = now, 0, 0.0

    def _record(self, rec: dict[str, float], extra: dict[str, Any], data_wait_s: float) -> dict[str, Any]:
        """The full record of a report (every field of :data:`whalepy.runtime.metrics.FIELDS`); ``rec``
        gains the fields the log line shows."""
        c = self.plan.cost
        step_s = rec["step_s"]
        capacity = _capacity_bytes(self.device)
        eta = (self.total_steps - self.steps) * step_s if self.total_steps else None
        full: dict[str, Any] = {
            "step": self.steps, "time": time.time(), "loss": rec["loss"], "grad_norm": extra.get("grad_norm"),
            "lr": extra.get("lr"), "loss_scale": extra.get("loss_scale"), "skipped_steps": self.skipped_steps,
            "step_s": step_s, "data_wait_s": data_wait_s,
            "plan_step_s": c.step_time_s if c.step_time_s > 0 else None,
            "tokens_per_s": rec.get("tokens_per_s"), "mfu": rec.get("mfu"), "peak_bytes": rec["peak_bytes"],
            "memory_share": rec["peak_bytes"] / capacity if capacity else None,
            "eta_s": max(eta, 0.0) if eta is not None else None}
        rec.update({k: v for k, v in full.items() if k in ("grad_norm", "lr", "loss_scale", "eta_s", "data_wait_s",
                                                           "memory_share") and v is not None})
        return full

    def _check_plan(self) -> None:
        """The closed loop (module docstring): every rank calls it at the same step (collectives)."""
        _synchronize(self.device)
        step_s = (time.perf_counter() - (self._check_start or 0.0)) / PLAN_CHECK_STEPS
        vals = torch.tensor([step_s, float(_peak_bytes(self.device))], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        c = self.plan.cost
        self.observed = ObservedStep(
            steps=PLAN_CHECK_STEPS, step_s=float(vals[0]), predicted_step_s=c.step_time_s,
            peak_bytes=int(vals[1]) if self.device.type == "cuda" else None,
            predicted_peak_bytes=max((s.cost.memory_bytes for s in self.plan.stages), default=0))
        if c.step_time_s <= 0:
            return
        o = self.observed
        mem = (f", peak memory {_bytes(o.peak_bytes)} vs plan {_bytes(o.predicted_peak_bytes)} "
               f"({o.memory_ratio:.2f}x)" if o.memory_ratio is not None else "")
        line = (f"whalepy: plan check over steps {PLAN_CHECK_WARMUP + 1}-{self.steps}: {_secs(o.step_s)}/step vs "
                f"plan {_secs(o.predicted_step_s)} ({o.step_ratio:.2f}x){mem}")
        if abs(o.step_ratio - 1) > OFF_PLAN_TOLERANCE:
            warn_once(f"plan-check-{self._serial}", "%s: more than %d%% off the prediction; re-plan from what this run "
                      "measures: after step %d, whalepy.plan(model, cluster, profile=pm.measured_profile(), "
                      "global_batch=...)", line, int(100 * OFF_PLAN_TOLERANCE), SAMPLED_STEP)
        else:
            info_once(f"plan-check-{self._serial}", "%s", line)

    def _sampled_step(self) -> None:
        """Step :data:`SAMPLED_STEP`'s per-block times, every rank's (a collective: every rank calls it)."""
        assert self.timer is not None
        timing = build_step_timing(gather_records(self.timer.finish()), self.plan, self.timer.profile, self.steps)
        self.timing = timing
        if self.observed is not None:
            self.observed = replace(self.observed, timing=timing)
        info_once(f"sampled-step-{self._serial}", "%s", "\n".join(_timing_lines(timing)))

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
        if "memory_share" in rec:
            parts[-1] += f" ({100 * rec['memory_share']:.0f}%)"
        if "grad_norm" in rec:
            parts.append(f"grad norm {rec['grad_norm']:.3g}")
        if "lr" in rec:
            parts.append(f"lr {rec['lr']:.3g}")
        if "loss_scale" in rec:
            parts.append(f"loss scale {rec['loss_scale']:.0f} ({self.skipped_steps} skipped)")
        if rec.get("data_wait_s", 0.0) >= 1e-3:
            parts.append(f"data wait {_secs(rec['data_wait_s'])}/step")
        if "eta_s" in rec:
            parts.append(f"ETA {_eta(rec['eta_s'])}")
        return " | ".join(parts)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self._progress is not None:
            self._progress[0].stop()
            self._progress = None


def _timing_lines(timing: StepTiming) -> list[str]:
    """One line per stage of the sampled step: measured next to the plan's."""
    lines = [f"whalepy: step {timing.step} timed per block (hooks on), per stage measured vs plan:"]
    for s in timing.stages:
        opt = f", optimizer {_secs(s.optimizer_s)}" if s.optimizer_s is not None else ""
        lines.append(f"whalepy:   stage {s.stage}: step {_secs(s.step_s)}, compute {_secs(s.compute_s)} "
                     f"(plan {_secs(s.predicted_compute_s)}){opt}, exposed communication + bubble + host "
                     f"{_secs(max(s.rest_s, 0.0))} (plan, optimizer included: {_secs(s.predicted_rest_s)})")
    return lines


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
