"""What the runtime can lower, in one place: the planner's enumeration, ``whalepy.estimate`` and the
runtime's refusals all ask these functions, so the planner never proposes what the runtime cannot run.

Pipeline shape (this part):

- :func:`schedule_error`: a schedule with its virtual stages (chunks per rank).
- :func:`microbatch_error`: the micro-batch counts ``torch.distributed.pipelining``'s schedules accept.
- :func:`sequence_parallel_error`: sequence parallelism together with pipeline stages.
- :func:`check_pipeline`: all three, raising :class:`~whalepy.PlanError`.

Each ``*_error`` returns why not (one line that names the fix), or None when the runtime lowers it.
Kept free of ``torch.distributed`` imports so the planner and the cost models can consult it.
"""

from __future__ import annotations

from whalepy._errors import PlanError
from whalepy.plan import Schedule

__all__ = ["check_pipeline", "microbatch_error", "schedule_error", "sequence_parallel_error"]


def schedule_error(schedule: Schedule | str, *, num_stages: int, virtual_stages: int) -> str | None:
    """Why the runtime cannot run ``schedule`` over ``num_stages`` pipeline ranks with ``virtual_stages``
    model chunks per rank, or None.

    GPipe and 1F1B run one stage per rank (``ScheduleGPipe`` / ``Schedule1F1B`` take one
    ``PipelineStage``); several chunks per rank need ``ScheduleInterleaved1F1B``. Without pipeline
    stages there is no schedule to run chunks with, so ``virtual_stages`` must be 1."""
    schedule = Schedule(schedule)
    if virtual_stages < 1 or num_stages < 1:
        return f"num_stages ({num_stages}) and virtual_stages ({virtual_stages}) must be at least 1"
    if virtual_stages > 1 and num_stages == 1:
        return (f"virtual_stages={virtual_stages} without pipeline stages: model chunks are interleaved over "
                "pipeline ranks; use virtual_stages=1 or pp > 1")
    if virtual_stages > 1 and schedule is not Schedule.INTERLEAVED_1F1B:
        return (f"schedule {schedule.value} runs one stage per rank, not {virtual_stages} chunks; use "
                f"{Schedule.INTERLEAVED_1F1B.value} or virtual_stages=1")
    return None


def microbatch_error(schedule: Schedule | str, *, num_stages: int, num_microbatches: int) -> str | None:
    """Why ``torch.distributed.pipelining`` refuses ``num_microbatches`` for ``schedule`` over
    ``num_stages`` pipeline ranks, or None. Without pipeline stages any count runs (gradient
    accumulation).

    - ``Schedule1F1B`` needs at least as many micro-batches as stages (it raises otherwise).
    - ``ScheduleInterleaved1F1B`` runs ``max(1, M // S)`` rounds and needs ``M`` to be a multiple of
      them.
    - ``ScheduleGPipe`` takes any count."""
    schedule = Schedule(schedule)
    S, M = num_stages, num_microbatches
    if M < 1:
        return f"num_microbatches must be at least 1, got {M}"
    if S == 1:
        return None
    if schedule is Schedule.ONE_F_ONE_B and M < S:
        return (f"1F1B with {M} micro-batches over {S} pipeline stages: torch.distributed.pipelining's "
                f"Schedule1F1B needs at least as many micro-batches as stages; use num_microbatches >= {S} "
                "or schedule 'gpipe'")
    rounds = max(1, M // S)
    if schedule is Schedule.INTERLEAVED_1F1B and M % rounds:
        return (f"interleaved 1F1B with {M} micro-batches over {S} pipeline stages: "
                f"ScheduleInterleaved1F1B runs {rounds} rounds and needs a multiple of them; use a multiple "
                f"of {S} micro-batches")
    return None


def sequence_parallel_error(*, sequence_parallel: bool, num_stages: int) -> str | None:
    """Why sequence parallelism cannot run with ``num_stages`` pipeline stages, or None.

    Between sequence-parallel blocks the residual stream is a sequence shard (a local
    ``[batch, seq / t, hidden]`` tensor, :mod:`whalepy.runtime.tensor_parallel`); pipeline stages send
    and receive whole activations, so the shard cannot cross a stage boundary."""
    if sequence_parallel and num_stages > 1:
        return (f"sequence parallelism with {num_stages} pipeline stages: the sequence-sharded residual "
                "stream cannot cross pipeline stages; plan with pp=1, or profile and plan without "
                "sequence_parallel")
    return None


def check_pipeline(schedule: Schedule | str, *, num_stages: int, virtual_stages: int, num_microbatches: int,
                   sequence_parallel: bool, where: str = "") -> None:
    """Raise :class:`PlanError` (prefixed by ``where``) with the first reason the runtime cannot lower
    this pipeline shape."""
    for reason in (schedule_error(schedule, num_stages=num_stages, virtual_stages=virtual_stages),
                   microbatch_error(schedule, num_stages=num_stages, num_microbatches=num_microbatches),
                   sequence_parallel_error(sequence_parallel=sequence_parallel, num_stages=num_stages)):
        if reason is not None:
            raise PlanError(f"{where}{': ' if where else ''}{reason}")
