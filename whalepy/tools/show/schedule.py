"""The pipeline schedule of a plan as a timeline: the order in which each pipeline rank runs its forward
and backward passes, and when each runs, from the plan's predicted per-stage times.

The op order per rank is the one ``torch.distributed.pipelining`` executes (the runtime lowers
whalepy's schedules onto it, see whalepy/runtime/pipeline.py):

- GPipe (``ScheduleGPipe``): every forward, then every backward, micro-batches in order;
- 1F1B (``Schedule1F1B``): ``min(M, S - s)`` warm-up forwards on stage ``s``, then one backward and
  one forward alternately, then the remaining backwards;
- interleaved 1F1B (``ScheduleInterleaved1F1B``): micro-batches go through the ``v`` local chunks in
  rounds of ``M / max(1, M // S)``; ``(v - 1)`` rounds plus ``2 (S - 1 - s)`` warm-up forwards, then
  1F1B between a forward chunk walking up and a backward chunk walking down (chunk ``k`` of rank ``s``
  is virtual stage ``s + k S``). tests/test_show.py checks these orders against torch's own.

Timing is a list-scheduling simulation: each rank runs its ops in that order, an op starts when its
rank is free and its input has arrived (the forward of virtual stage ``j`` waits for the forward of
``j - 1`` plus one send, the backward waits for the backward of ``j + 1`` plus one send, or for its own
forward on the last virtual stage). Idle gaps on a rank are the bubbles. After its last backward each
rank synchronises gradients (``StageCost.grad_sync_s``) and waits for offload transfers
(``StageCost.offload_s``). The planner's step time (``M T + (S - 1) Tc + X``, whalepy/planner/costing.py)
is a closed form of the same picture plus the optimizer step; the page shows both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from whalepy.errors import PlanError

if TYPE_CHECKING:
    from whalepy.ir.plan import Plan

BACKWARD_PER_FORWARD = 2.0
"""Used only for plans that predate ``StageCost.chunk_forward_s``: a backward pass does twice the
forward's GEMM FLOPs (the gradients of the input and of the weight; Narayanan et al., SC'21, section
3.3), so the stage's compute splits 1 : 2 between forward and backward."""


class OpKind(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    SEND = "send"
    GRAD_SYNC = "grad_sync"
    OFFLOAD = "offload"
    BUBBLE = "bubble"


@dataclass(frozen=True, slots=True)
class PipeOp:
    """One forward or backward of micro-batch ``microbatch`` through virtual stage ``stage``."""

    kind: OpKind
    stage: int
    microbatch: int


@dataclass(frozen=True, slots=True)
class TimedOp:
    kind: OpKind
    rank: int
    """Pipeline rank (physical stage index)."""
    stage: int
    """Virtual stage (``-1`` for per-step ops and bubbles)."""
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Timeline:
    num_ranks: int
    virtual_stages: int
    num_microbatches: int
    ops: tuple[TimedOp, ...]
    makespan_s: float
    notes: tuple[str, ...] = ()

    def of_rank(self, rank: int, kind: OpKind | None = None) -> list[TimedOp]:
        return [o for o in self.ops if o.rank == rank and (kind is None or o.kind is kind)]

    def busy_s(self, rank: int) -> float:
        return sum(o.end_s - o.start_s for o in self.of_rank(rank) if o.kind in _COMPUTE)

    def bubble_s(self, rank: int) -> float:
        return sum(o.end_s - o.start_s for o in self.of_rank(rank, OpKind.BUBBLE))


_COMPUTE = (OpKind.FORWARD, OpKind.BACKWARD)


# -- op order -------------------------------------------------------------------------------------

def gpipe_order(rank: int, num_ranks: int, num_microbatches: int) -> list[PipeOp]:
    M = num_microbatches
    return ([PipeOp(OpKind.FORWARD, rank, m) for m in range(M)]
            + [PipeOp(OpKind.BACKWARD, rank, m) for m in range(M)])


def one_f_one_b_order(rank: int, num_ranks: int, num_microbatches: int) -> list[PipeOp]:
    M = num_microbatches
    warmup = min(M, num_ranks - rank)
    ops = [PipeOp(OpKind.FORWARD, rank, m) for m in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        ops.append(PipeOp(OpKind.BACKWARD, rank, bwd))
        bwd += 1
        if fwd == M:
            break
        ops.append(PipeOp(OpKind.FORWARD, rank, fwd))
        fwd += 1
    ops += [PipeOp(OpKind.BACKWARD, rank, m) for m in range(bwd, M)]
    return ops


def interleaved_order(rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int) -> list[PipeOp]:
    S, M, v = num_ranks, num_microbatches, virtual_stages
    rounds = max(1, M // S)
    if M % rounds:
        raise PlanError(f"interleaved 1F1B needs the {M} micro-batches to be a multiple of the {rounds} rounds "
                        f"(max(1, M // {S} stages)); choose a micro-batch count divisible by {rounds}")
    per_round = M // rounds
    total = v * M
    warmup = min((v - 1) * per_round + 2 * (S - 1 - rank), total)
    steady = total - warmup

    def fwd_stage(op: int) -> int:
        return ((op // per_round) % v) * S + rank

    def bwd_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * S + rank

    next_mb: dict[tuple[OpKind, int], int] = {}
    ops: list[PipeOp] = []

    def add(kind: OpKind, stage: int) -> None:
        m = next_mb.get((kind, stage), 0)
        next_mb[(kind, stage)] = m + 1
        ops.append(PipeOp(kind, stage, m))

    for op in range(warmup + steady + warmup):
        if op < warmup + steady:
            add(OpKind.FORWARD, fwd_stage(op))
        if op >= warmup:
            add(OpKind.BACKWARD, bwd_stage(op))
    return ops


def op_order(plan: Plan, rank: int) -> list[PipeOp]:
    """The forwards and backwards pipeline rank ``rank`` runs, in the order torch runs them."""
    from whalepy.ir.plan import Schedule

    S, M = plan.pp_degree, plan.num_microbatches
    if plan.schedule is Schedule.GPIPE:
        return gpipe_order(rank, S, M)
    if plan.schedule is Schedule.ONE_F_ONE_B:
        return one_f_one_b_order(rank, S, M)
    return interleaved_order(rank, S, M, plan.virtual_stages)


# -- per-op times ----------------------------------------------------------------------------------

def chunk_times(plan: Plan) -> tuple[list[list[tuple[float, float]]], list[str]]:
    """``times[s][k] = (forward_s, backward_s)`` per micro-batch of chunk ``k`` on stage ``s``."""
    notes: list[str] = []
    out = []
    v = plan.virtual_stages
    for st in plan.stages:
        c = st.cost
        if len(c.chunk_forward_s) == v and len(c.chunk_backward_s) == v:
            out.append(list(zip(c.chunk_forward_s, c.chunk_backward_s)))
            continue
        sizes = st.chunk_sizes or (len(st.blocks),)
        busy = c.compute_s + c.tp_comm_s + c.dp_comm_s
        fwd_share = 1.0 / (1.0 + BACKWARD_PER_FORWARD)
        out.append([(busy * n / len(st.blocks) * fwd_share, busy * n / len(st.blocks) * (1 - fwd_share))
                    for n in sizes])
        if not notes:
            notes.append("this plan has no per-chunk forward/backward times (written by an older whalepy): "
                         "each stage's compute is split by block count and 1 : 2 between forward and backward")
    return out, notes


def send_time(plan: Plan, rank: int) -> float:
    """One point-to-point send of stage ``rank``: its ``p2p_s`` per micro-batch over its sends."""
    S, v = plan.pp_degree, plan.virtual_stages
    last = S * v - 1
    sends = sum((j < last) + (j > 0) for j in range(rank, S * v, S))
    return plan.stages[rank].cost.p2p_s / sends if sends else 0.0


# -- simulation ------------------------------------------------------------------------------------

def simulate(plan: Plan) -> Timeline:
    """Time every rank's ops in order; see the module docstring."""
    S, v, M = plan.pp_degree, plan.virtual_stages, plan.num_microbatches
    last = S * v - 1
    times, notes = chunk_times(plan)
    sends = [send_time(plan, r) for r in range(S)]
    orders = [op_order(plan, r) for r in range(S)]
    pos = [0] * S
    free = [0.0] * S
    done: dict[tuple[OpKind, int, int], float] = {}
    timed: list[TimedOp] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(S):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                if op.kind is OpKind.FORWARD:
                    dep = (OpKind.FORWARD, op.stage - 1, op.microbatch) if op.stage > 0 else None
                elif op.stage < last:
                    dep = (OpKind.BACKWARD, op.stage + 1, op.microbatch)
                else:
                    dep = (OpKind.FORWARD, op.stage, op.microbatch)  # the loss: no send
                if dep is not None and dep not in done:
                    break
                ready = 0.0
                if dep is not None:
                    sender = dep[1] % S
                    ready = done[dep] + (sends[sender] if dep[1] != op.stage and sender != r else 0.0)
                fwd, bwd = times[r][op.stage // S]
                start = max(free[r], ready)
                end = start + (fwd if op.kind is OpKind.FORWARD else bwd)
                timed.append(TimedOp(op.kind, r, op.stage, op.microbatch, start, end))
                if (op.kind is OpKind.FORWARD and op.stage < last) or (op.kind is OpKind.BACKWARD and op.stage > 0):
                    timed.append(TimedOp(OpKind.SEND, r, op.stage, op.microbatch, end, end + sends[r]))
                done[(op.kind, op.stage, op.microbatch)] = end
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlanError(f"the {plan.schedule.value} schedule deadlocks on this plan (S={S}, v={v}, M={M}); "
                            "this is a whalepy bug, please report it with the plan file")
    for r, st in enumerate(plan.stages):
        t = free[r]
        for kind, dur in ((OpKind.GRAD_SYNC, st.cost.grad_sync_s), (OpKind.OFFLOAD, st.cost.offload_s)):
            if dur > 0:
                timed.append(TimedOp(kind, r, -1, -1, t, t + dur))
                t += dur
        free[r] = t
    makespan = max(free)
    for r in range(S):
        busy = sorted((o.start_s, o.end_s) for o in timed if o.rank == r and o.kind is not OpKind.SEND)
        t = 0.0
        for a, b in busy + [(makespan, makespan)]:
            if a > t + 1e-12 * max(1.0, makespan):
                timed.append(TimedOp(OpKind.BUBBLE, r, -1, -1, t, a))
            t = max(t, b)
    return Timeline(num_ranks=S, virtual_stages=v, num_microbatches=M, ops=tuple(timed), makespan_s=makespan,
                    notes=tuple(notes))
