"""The metrics record of a logged training step, and where it goes.

Every ``log_every`` steps, :class:`~whalepy.runtime._report.StepReporter` builds one record (a flat
dict, the same keys every time; ``None`` where a field does not apply) and hands it, on rank 0, to the
log line and to each sink given to ``parallelize(..., metrics=[...])``:

- :class:`JsonlSink` appends it as one JSON object per line;
- :class:`TensorBoardSink` writes each number as a scalar under ``whalepy/<field>`` at its step
  (``torch.utils.tensorboard``; the ``tensorboard`` package, extra ``whalepy[tensorboard]``);
- :class:`WandbSink` logs it to Weights & Biases (extra ``whalepy[wandb]``; off unless given).

A sink's optional package is imported when the sink is built, before any planning or lowering, so a
missing one is one line (:class:`~whalepy.WhalepyError`) and not a failure after the first steps.
:data:`FIELDS` is the schema (docs/training.md prints it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from whalepy.errors import ArgumentError, WhalepyError

__all__ = ["FIELDS", "JsonlSink", "MetricsSink", "TensorBoardSink", "WandbSink", "check_job_options"]

FIELDS: dict[str, str] = {
    "step": "optimizer steps taken (int)",
    "time": "Unix time of the report (s)",
    "loss": "the global batch's mean loss of this step (every rank's share included)",
    "grad_norm": "global 2-norm of the gradients before clipping (the whole model, any layout)",
    "lr": "learning rate of the optimizer's first parameter group after this step (the next step's)",
    "loss_scale": "fp16 dynamic loss scale this step ran with; null in bf16 / fp32",
    "skipped_steps": "fp16 steps skipped since the start (gradients not finite; the scale backed off); 0 otherwise",
    "step_s": "mean wall time per step since the last report, data wait included (s)",
    "data_wait_s": "mean time per step spent outside train_step since the last report: loading data (s)",
    "plan_step_s": "the plan's predicted step time (s); null when the plan has no cost",
    "tokens_per_s": "tokens of the global batch per second of step_s; null when the inputs are not token ids",
    "mfu": "model FLOPs utilisation at step_s, on the plan's FLOPs and peak; null when the plan has no cost",
    "peak_bytes": "peak memory, largest over ranks: CUDA's peak allocated bytes, peak RSS on CPU",
    "memory_share": "peak_bytes over the device's memory (host RAM on CPU, where the ranks share it)",
    "eta_s": "(total_steps - step) x step_s; null without parallelize(total_steps=...)",
}


class MetricsSink:
    """Receives every record (rank 0 only). Subclass and override :meth:`write`."""

    def write(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None


class JsonlSink(MetricsSink):
    """Append each record to ``path`` as one JSON line (the file is created on the first write)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ArgumentError(f"JsonlSink({path!r:.60}): give a file path, e.g. JsonlSink('metrics.jsonl')")
        self.path = Path(path)
        parent = self.path.parent
        if parent.exists() and not os.access(parent, os.W_OK):
            raise WhalepyError(f"JsonlSink({os.fspath(path)!r}): {os.fspath(parent)!r} is not writable; give a "
                               "path in a writable directory")
        self._file: Any = None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink(MetricsSink):
    """Each numeric field as a TensorBoard scalar ``whalepy/<field>`` at the record's step."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise WhalepyError("TensorBoardSink needs the tensorboard package: pip install tensorboard "
                               "(or whalepy[tensorboard]), or leave the sink out") from None
        self._cls = SummaryWriter
        self.log_dir = os.fspath(log_dir)
        self._writer: Any = None

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            self._writer = self._cls(log_dir=self.log_dir)
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"whalepy/{key}", value, global_step=int(record["step"]))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink(MetricsSink):
    """Log each record to Weights & Biases: ``wandb.init(**init_kwargs)`` at the first record, then
    ``wandb.log(record, step=step)``."""

    def __init__(self, **init_kwargs: Any) -> None:
        try:
            import wandb
        except ImportError:
            raise WhalepyError("WandbSink needs the wandb package: pip install wandb (or whalepy[wandb]), or "
                               "leave the sink out") from None
        self._wandb = wandb
        self.init_kwargs = init_kwargs
        self._run: Any = None

    def write(self, record: dict[str, Any]) -> None:
        if self._run is None:
            self._run = self._wandb.init(**self.init_kwargs)
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def check_job_options(lr_scheduler: Any, total_steps: Any, metrics: Any) -> None:
    """``parallelize``'s training-job options, before any work."""
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise ArgumentError(f"parallelize(lr_scheduler={lr_scheduler!r:.60}) takes a factory optimizer -> "
                            "scheduler, e.g. lr_scheduler=lambda opt: torch.optim.lr_scheduler."
                            "CosineAnnealingLR(opt, T_max=1000)")
    if lr_scheduler is not None and hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "optimizer"):
        raise ArgumentError(f"parallelize(lr_scheduler=...) takes a factory, got a {type(lr_scheduler).__name__} "
                            "instance bound to an optimizer whalepy replaces; pass e.g. lr_scheduler=lambda opt: "
                            "torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)")
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 1):
        raise ArgumentError(f"parallelize(total_steps={total_steps!r:.60}): give the job's number of steps "
                            "(an integer >= 1, for the ETA), or None")
    if not isinstance(metrics, Sequence) or isinstance(metrics, str):
        raise ArgumentError(f"parallelize(metrics={metrics!r:.60}) takes a list of sinks, e.g. "
                            "metrics=[whalepy.runtime.metrics.JsonlSink('metrics.jsonl')]")
    for sink in metrics:
        if not callable(getattr(sink, "write", None)):
            raise ArgumentError(f"parallelize(metrics=[...]) got a {type(sink).__name__}, not a sink with write("
                                "record); use JsonlSink, TensorBoardSink or WandbSink of whalepy.runtime.metrics")
