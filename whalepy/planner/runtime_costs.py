"""How the runtime runs data parallelism, in the terms of the cost model: which wrapper a state option is
lowered to (the runtime's own :func:`~whalepy.ir.rules.choose_lowering_kind`), which of its
collectives overlap which compute (per block, with contention), what it holds beside the model states,
and how much device memory is left to the allocator. Used by :mod:`whalepy.planner.costing`; formulas
in docs/cost_model.md ("Overlap with compute", "Buffers and working sets", "Reserve").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from whalepy.cost_models.communication import OVERLAP_COMPUTE_LOSS, Collective, CommGroup, estimate_overlapped_time
from whalepy.cost_models.compute import precision_bytes
from whalepy.cost_models.memory import (
    ALLOCATOR_FRAGMENTATION,
    MASTER_GRAD_BYTES,
    estimate_fixed_device_bytes,
    estimate_usable_device_bytes,
)
from whalepy.ir.rules import LoweringKind, choose_lowering_kind, offloads_to_host, tp_splits
from whalepy.ir.types import Schedule, TPStyle, dtype_bytes
from whalepy.errors import InfeasibleError
from whalepy.planner.margin import MemoryMargin
from whalepy.planner.space import Candidate, GroupView, Segment, StateOption

CollectiveFn = Callable[[Collective, float, CommGroup], float]

_FIT_N1, _FIT_N2 = float(2**30), float(2**31)


def affine_fit(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """``(alpha, beta)`` with ``fn(n) = alpha + beta n`` for ``n > 0`` (alpha-beta costs are affine)."""
    f1, f2 = fn(_FIT_N1), fn(_FIT_N2)
    beta = (f2 - f1) / (_FIT_N2 - _FIT_N1)
    return max(0.0, f1 - beta * _FIT_N1), beta


def usable_device_bytes(g: GroupView, cand: Candidate, margin: MemoryMargin | None = None) -> float:
    """Peak allocated bytes one device of ``g`` may reach in ``cand``: its memory less the CUDA context
    and one NCCL communicator per parallel axis in use, less the allocator's fragmentation
    (:func:`~whalepy.cost_models.memory.estimate_usable_device_bytes`), less the ``margin`` the user
    leaves unplanned. CPU devices (gloo) have no CUDA context or NCCL buffers."""
    left = margin.bytes_for(g.device.memory_bytes) if margin is not None else 0.0
    if g.device.vendor == "cpu":
        return max(0.0, g.device.memory_bytes / (1 + ALLOCATOR_FRAGMENTATION) - left)
    comms = sum(1 for degree in (cand.dp, cand.tp, cand.num_stages) if degree > 1)
    return max(0.0, estimate_usable_device_bytes(memory_bytes=g.device.memory_bytes, num_communicators=comms) - left)


def check_device_reserve(groups: tuple[GroupView, ...], world_size: int) -> None:
    """Raise :class:`~whalepy.InfeasibleError` for a GPU whose memory does not exceed what every
    candidate reserves beside the allocator: the CUDA context, and one NCCL communicator when there is
    more than one device (every layout of several devices uses at least one parallel axis)."""
    reserve = estimate_fixed_device_bytes(1 if world_size > 1 else 0)
    for g in groups:
        if g.device.vendor != "cpu" and g.device.memory_bytes <= reserve:
            raise InfeasibleError(
                f"device {g.device.name!r} (group {g.name!r}) has {g.device.memory_bytes / 2**30:.3g} GiB of "
                f"memory, not more than the {reserve / 2**30:.3g} GiB reserved for the CUDA context"
                f"{' and an NCCL communicator' if world_size > 1 else ''} (cost_models/memory.py): give the "
                "device's real memory_gb in the cluster spec, or use larger devices")


def lowering_kind(o: StateOption, cand: Candidate) -> str:
    """How the runtime lowers data parallelism for state option ``o`` in candidate ``cand`` (the
    runtime's own :func:`~whalepy.ir.rules.choose_lowering_kind`: DDP, DDP + ZeroRedundancyOptimizer,
    FSDP2, or nothing)."""
    offload = offloads_to_host(o.param_tier, o.optimizer_tier) or o.beside_offload
    return choose_lowering_kind(o.zero, cand.dp, tp=cand.tp, pp=cand.num_stages, offload=offload)


def grads_at_activation_peak(kind: str, cand: Candidate) -> bool:
    """Whether gradients are held while the activations peak (the end of a forward). The runtime frees
    them after every step (``zero_grad(set_to_none=True)``), so with one micro-batch and no pipeline they
    are only created as backward frees activations; they are held through the forward when micro-batches
    accumulate into them and when a pipeline interleaves forwards and backwards. Under DDP (and ZeRO-1,
    DDP with ``ZeroRedundancyOptimizer``) they are always held: with ``gradient_as_bucket_view=True``
    they are views of the reducer's gradient buckets, which the reducer allocates once and keeps through
    ``set_to_none`` (traced on the CPU: ``gpt-wide`` DDP's peak was one gradient copy over the
    prediction that freed them, benchmarks/bench_predict_cpu.py). The separate gradients autograd
    accumulates under ``no_sync`` beside those buckets are a buffer (``costing``'s ``bucket``).
    A GPipe pipeline runs every micro-batch's forward before the first backward, so its activations peak
    before any gradient exists too; its second peak, after the first micro-batch's backward, holds the
    gradients (:func:`grads_after_forwards`)."""
    if kind in (LoweringKind.DDP, LoweringKind.ZERO1):
        return True
    if cand.num_stages > 1:
        return not grads_after_forwards(kind, cand)
    return cand.num_microbatches > 1


def grads_after_forwards(kind: str, cand: Candidate) -> bool:
    """Whether every micro-batch's forward runs before the gradients exist: a GPipe pipeline
    (``torch.distributed.pipelining``'s ``ScheduleGPipe``: all forwards, then all backwards). Its stage
    then peaks either at the end of the forwards (``M`` micro-batches' activations, no gradients) or
    after the first micro-batch's backward (the gradients and ``M - 1`` micro-batches' activations),
    whichever is larger. Traced on 2 gloo ranks (``gpt-wide`` of benchmarks/bench_predict_cpu.py, GPipe
    with 2 micro-batches): the peaks are at the first backward, without gradients; charging them was
    +10.8% and +11.4% over the traced peaks."""
    return (cand.num_stages > 1 and cand.schedule is Schedule.GPIPE
            and kind not in (LoweringKind.DDP, LoweringKind.ZERO1))


def uses_autocast(kind: str, precision: str) -> bool:
    """Whether a 16-bit plan trains under ``torch.autocast`` over fp32 parameters (DDP and
    single-device paths) rather than FSDP2's ``MixedPrecisionPolicy`` with 16-bit parameters
    (design.md, Precision): autocast keeps 16-bit copies of the weights for backward."""
    return precision != "fp32" and kind in (LoweringKind.NONE, LoweringKind.DDP, LoweringKind.ZERO1)


LOSS_REPORT_BYTES = 4
"""Payload of the one collective of a step that is not data parallelism: ``ParallelModel.train_step``
all-reduces the step's mean loss, an fp32 scalar, over all ranks to return it."""


def dp_payload_bytes_per_param(collective: Collective, precision: str) -> float:
    """Bytes per parameter of one data-parallel collective as the runtime issues it (the payload in
    :mod:`whalepy.cost_models.communication`'s size convention), in ``precision``:

    - FSDP2's all-gather: the compute dtype (``MixedPrecisionPolicy.param_dtype``; fp32 parameters in
      an fp32 plan);
    - FSDP2's reduce-scatter: fp32 (``reduce_dtype=float32``, the gradients are reduced in fp32 in
      every precision);
    - DDP's all-reduce: fp32 (the gradients of the fp32 parameters autocast trains);
    - ZeroRedundancyOptimizer's broadcast of the updated parameters after the step: fp32 parameters.

    Checked against the bytes counted at the process group on gloo (``whalepy study zero --measure``,
    tests/test_zero_study.py)."""
    if collective is Collective.ALL_GATHER:
        return float(precision_bytes(precision))
    if collective in (Collective.REDUCE_SCATTER, Collective.ALL_REDUCE, Collective.BROADCAST):
        return float(MASTER_GRAD_BYTES)
    raise ValueError(f"the runtime issues no data-parallel {collective.value}")


def dp_step_payload_bytes(kind: str, *, zero3: bool, num_params: float, num_microbatches: int,
                          precision: str, pipelined: bool = False) -> dict[Collective, float]:
    """Payload bytes of one rank's data-parallel collectives in one training step (``num_params``
    parameters on this rank, ``num_microbatches`` micro-batches accumulated by whalepy's own loop, or
    run by a pipeline schedule where ``pipelined``), by collective, as the runtime issues them:

    - FSDP2: every unit is all-gathered before its forward in every micro-batch (FSDP2 reshards after
      backward) and, under ZeRO-3 (``reshard_after_forward=True``), again before its backward; the root
      unit too (FSDP2 reshards it after forward as well, counted on torch 2.13). The gradients are
      reduce-scattered once, in the last micro-batch (``set_requires_gradient_sync``);
    - FSDP2 under a pipeline schedule: the stage keeps its parameters gathered after each backward
      (``set_reshard_after_backward(False)``) until the step's ``REDUCE_GRAD``. Below ZeRO-3 that is one
      all-gather per step. Under ZeRO-3 a forward reshards, so a unit is gathered by every forward that
      follows a forward (or starts the step) and by every backward that follows a forward: for any order
      of one chunk's ``M`` forwards and ``M`` backwards (GPipe, 1F1B, interleaved) that is ``M + 1``
      all-gathers (a run of forwards costs one gather per forward, the backward after it one more, the
      forward after a backward none). One reduce-scatter per step, as without stages;
    - DDP: one all-reduce of the gradients, in the last micro-batch (``no_sync`` before); the
      bucketing splits it into calls but adds no bytes;
    - DDP + ZeroRedundancyOptimizer: that all-reduce, and each rank's updated partition broadcast
      to the others after the step.

    Not counted: FSDP2 pads every parameter's first dimension to a multiple of the dp degree (at most
    ``dp - 1`` rows per parameter; none for the T5 / GPT shapes of the study on 4 or 8 ranks), and
    one-time traffic (DDP's initial broadcast and its bucket rebuild in the second step)."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    b = functools.partial(dp_payload_bytes_per_param, precision=precision)
    P = num_params
    if kind == LoweringKind.FSDP:
        if pipelined:
            gathers = num_microbatches + 1 if zero3 else 1
        else:
            gathers = num_microbatches * (2 if zero3 else 1)
        return {Collective.ALL_GATHER: gathers * b(Collective.ALL_GATHER) * P,
                Collective.REDUCE_SCATTER: b(Collective.REDUCE_SCATTER) * P}
    if kind == LoweringKind.DDP:
        return {Collective.ALL_REDUCE: b(Collective.ALL_REDUCE) * P}
    if kind == LoweringKind.ZERO1:
        return {Collective.ALL_REDUCE: b(Collective.ALL_REDUCE) * P, Collective.BROADCAST: b(Collective.BROADCAST) * P}
    return {}


def chunk_neighbours(stage: int, num_stages: int, virtual_stages: int) -> list[list[int]]:
    """Per chunk ``k`` of physical stage ``stage`` (virtual stage ``stage + k * num_stages``), the
    physical stages of its neighbouring virtual stages held by other ranks: each of them gets one
    point-to-point send per micro-batch from this chunk (activations forward to the next, gradients
    backward to the previous) and sends one to it."""
    J = num_stages * virtual_stages
    out = []
    for k in range(virtual_stages):
        j = stage + k * num_stages
        out.append([nj % num_stages for nj in (j + 1, j - 1) if 0 <= nj < J and nj % num_stages != stage])
    return out


def boundary_bytes(output_bytes: list[float], profile_dtype: str, precision: str) -> float:
    """Bytes of one message between pipeline stages for the profile's batch, as the cost model charges
    it: the largest output of a block that is not the last (``output_bytes``: every block's, in model
    order; the profile measures them in its own dtype ``profile_dtype``), in the training precision
    (stages send their floating-point outputs in the compute dtype)."""
    nonfinal = list(output_bytes[:-1]) or [0.0]
    scale = precision_bytes(precision) / dtype_bytes(profile_dtype)
    return float(max(nonfinal)) * scale


def pipeline_step_payload_bytes(message_bytes: float, *, stage: int, num_stages: int, virtual_stages: int,
                                num_microbatches: int) -> dict[Collective, float]:
    """Point-to-point payload of one training step on a rank of physical stage ``stage``, in
    :class:`~whalepy.tools.comm_count.CollectiveCounter`'s convention (a rank's sends and its receives
    each counted): per micro-batch and per neighbour of each of its chunks (:func:`chunk_neighbours`),
    one message of ``message_bytes`` (the cost model's boundary, :func:`boundary_bytes`, for one
    micro-batch) sent and one received. The planner charges the time of the sends (``_cells``)."""
    links = sum(len(n) for n in chunk_neighbours(stage, num_stages, virtual_stages))
    if not links:
        return {}
    return {Collective.SEND_RECV: 2.0 * num_microbatches * links * message_bytes}


def tp_backward_bytes(block) -> float:  # type: ignore[no-untyped-def]
    """Bytes a tensor-parallel block all-reduces in its backward (``tp_comm_backward_bytes``, the
    column-parallel modules' input gradients); profiles that do not record it (synthetic models) are
    charged their forward's bytes again, Megatron's one all-reduce per row-parallel one."""
    recorded = block.tp_comm_backward_bytes
    return float(block.tp_comm_bytes if recorded is None else recorded)


def tp_step_payload_bytes(blocks, *, tp: int, micro_batch: float, profile_batch: float, num_microbatches: int,
                          byte_scale: float, loss_parallel: bool = False) -> dict[Collective, float] | None:  # type: ignore[no-untyped-def]
    """Payload bytes of one rank's tensor-parallel collectives in one training step over ``blocks`` (the
    :class:`~whalepy.BlockProfile` s of its stage), each micro-batch of ``micro_batch`` samples (the
    profile measured ``profile_batch``; ``byte_scale``: the training precision's bytes per the
    profile's), by the rules the runtime applies (``runtime/tensor_parallel.py``) to a block that
    splits (:func:`~whalepy.ir.rules.tp_splits`; a block that runs whole issues none):

    - forward, an all-reduce of every ROWWISE module's and VOCAB embedding's output
      (``BlockProfile.tp_comm_bytes``);
    - backward, an all-reduce of the input gradient of the COLWISE modules (their input is replicated
      over the group, so each rank holds a partial sum): one per input that sibling linears share
      (separate q, k and v projections: one, as Megatron's ``f``), one per fused or Conv1D projection
      (:func:`tp_backward_bytes`);
    - a COLWISE module that ends a sharded region (an LM head: no ROWWISE module reads it) gathers its
      output forward (``tp_gather_bytes``, the logits), unless ``loss_parallel``.

    Not counted: a fused projection's replicated bias (HF GPT-2's ``c_attn``, ``3 h`` values per layer)
    and a fused ``nn.Linear`` weight, which the runtime keeps whole and slices, all-reducing their
    gradients every micro-batch. None under sequence parallelism (SEQUENCE rules: reduce-scatters and
    all-gathers in place of the all-reduces, not modelled here)."""
    if tp == 1:
        return {}
    scale = micro_batch / profile_batch * byte_scale * num_microbatches
    out = {Collective.ALL_REDUCE: 0.0, Collective.ALL_GATHER: 0.0}
    for b in blocks:
        if not tp_splits(b, tp):
            continue
        if any(r.style is TPStyle.SEQUENCE for r in b.tp_rules):
            return None
        out[Collective.ALL_REDUCE] += (b.tp_comm_bytes + tp_backward_bytes(b)) * scale
        if not loss_parallel:
            out[Collective.ALL_GATHER] += b.tp_gather_bytes * scale
    return {k: v for k, v in out.items() if v}


def tied_step_payload_bytes(stage_blocks, all_blocks, *, tp: int, dp: int, sharded: bool) -> dict[Collective, float]:  # type: ignore[no-untyped-def]
    """Payload bytes of the all-reduce that sums a tied weight's gradient over the pipeline stages
    holding a copy (``runtime/tied.py``, Megatron-LM's embedding group), once per step, on a rank whose
    stage (all its chunks: ``stage_blocks``) holds a block sharing a parameter (``shared_param_numel``)
    while a block sharing one sits on another stage: the rank's local gradient, in fp32, split by TP
    where its block splits and by the ``dp`` replicas where FSDP2 shards it (``sharded``). A weight
    shared by blocks of one rank only is summed without communication. The blocks sharing a weight
    are taken to share the same one (a tied embedding and head: every model here)."""
    mine = {b.name for b in stage_blocks}
    sharing = [b for b in stage_blocks if b.shared_param_numel]
    if not sharing or all(b.name in mine for b in all_blocks if b.shared_param_numel):
        return {}
    b = sharing[0]
    local = b.shared_param_numel / (tp if tp_splits(b, tp) else 1) / (dp if sharded else 1)
    return {Collective.ALL_REDUCE: local * MASTER_GRAD_BYTES}


@dataclass(frozen=True, slots=True)
class DPComm:
    """Seconds of one block's data-parallel collectives over the stage's DP group, per segment."""

    all_gather: tuple[float, ...]
    """All-gather of the block's parameters in the compute dtype."""
    reduce_scatter: tuple[float, ...]
    all_reduce: tuple[float, ...]
    """DDP's all-reduce of the block's gradients: their bytes, and their share of the calls of the
    25 MiB buckets they travel in (:func:`ddp_all_reduce_s`)."""
    rep: int
    """Segment of the stage's typical block (the longest segment): whose gather a chunk's first block
    exposes."""
    all_reduce_call: float = 0.0
    """Seconds of one all-reduce call beside its bytes (the link's per-call and latency terms)."""


def build_dp_block_comm(collective: CollectiveFn, segments: tuple[Segment, ...], seg_params: list[float],
                        group: CommGroup | None, precision: str, units: tuple[int, ...] | None = None) -> DPComm:
    """``units[g]``: the FSDP2 units (``fully_shard`` calls) a block of segment ``g`` is lowered as, each
    gathering and reducing its own share of the block's parameters in a call of its own (counted by
    measured planning, ``MeasuredCosts.fsdp_units``; 1 where not counted)."""
    rep = max(range(len(segments)), key=lambda g: segments[g].length) if segments else 0
    if group is None:
        zeros = tuple(0.0 for _ in seg_params)
        return DPComm(zeros, zeros, zeros, rep)
    calls = units or tuple(1 for _ in seg_params)

    def times(kind: Collective) -> tuple[float, ...]:
        per = dp_payload_bytes_per_param(kind, precision)
        return tuple(k * collective(kind, per * p / k, group) for p, k in zip(seg_params, calls))

    call, per_byte = affine_fit(lambda n: collective(Collective.ALL_REDUCE, n, group))
    per = dp_payload_bytes_per_param(Collective.ALL_REDUCE, precision)
    all_reduce = tuple(ddp_all_reduce_s(per * p, call, per_byte) for p in seg_params)
    return DPComm(times(Collective.ALL_GATHER), times(Collective.REDUCE_SCATTER), all_reduce, rep, call)


FSDP2_UNIT_HOST_S = 1.64e-3
"""Seconds FSDP2 adds to one of its units per micro-batch (forward and backward together) on a GPU
where measured planning did not time the wrapper (``CostContext.wrapper_overhead``): the host work of
its hooks (the all-gather's copy-in and copy-out, the reduce-scatter's ``chunk_cat`` and views, stream
waits), which the device waits for when a block's kernels do not keep it busy longer. MEASURED: the
median over the 36 rows of ``benchmarks/data/h200_2026-11-27/{gpt,llama}_measured.json`` (measured
planning on one H200, torch 2.11, compiled blocks of 0.16-9 ms per phase, FSDP2 on a fake process
group of 2, with and without resharding, micro-batches 1, 2 and 4: each row the wrapped block's forward
+ backward minus the plain compiled block's, per unit; GPT's embedding is two units): 0.94 ms in
forward (quartiles 0.70-1.14) and 0.54 ms in backward (0.23-1.18). Host time, so it depends on the host
and torch's version more than on the GPU. Charged only where the block's modelled forward + backward
per micro-batch is within :data:`FSDP2_HOST_MEASURED_MAX_S`, the range measured: beyond it nothing was
measured, and FSDP2 issues each unit's all-gather and launches its kernels without waiting for the
device, so a long block's kernels keep the device busy while the host does the next unit's hook work
(the host runs ahead). Without
it the analytic planner chose, for GPT 1.42B on one H200, FSDP2 over one host-stepped block (predicted
73.9 ms: FSDP2's bf16 parameters without autocast's casts) over the plain step (88.1 ms predicted, 81.5
measured), and that plan ran 214 ms (docs/benchmarks.md, "One H200, session 16")."""

FSDP2_HOST_MEASURED_MAX_S = 15.7e-3
"""The longest block (forward + backward per micro-batch) among the measurements behind
:data:`FSDP2_UNIT_HOST_S`: Llama 1.2B's compiled head at micro-batch 4 on the H200, 6.71 + 8.96 ms.
Longer blocks are not charged the hook work (the reason there)."""

DDP_BUCKET_BYTES = 25 * 2**20
"""``DistributedDataParallel``'s bucket capacity, which the runtime keeps (``bucket_cap_mb=None``: torch's
``_DEFAULT_BUCKET_CAP_MB`` = 25, torch/nn/parallel/distributed.py; tests/test_ddp_buckets.py checks it)."""

DDP_FIRST_BUCKET_BYTES = 2**20
"""The capacity of DDP's first bucket (the gradients ready first) with the default caps
(``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB)."""

DDP_EDGE_CALLS = 2
"""All-reduce calls of a DDP step that the 25 MiB buckets do not amortise: the first bucket (capped at
:data:`DDP_FIRST_BUCKET_BYTES`) and the last, partly filled one. A stage of ``P`` bytes makes
``1 + ceil((P - first) / cap)`` calls (:func:`ddp_bucket_calls`); charging ``P / cap`` of them per byte
and these two per step is at most one call too many (none for the gpt-deep stage of
``bench_predict_cpu.py``, 6.9 MB in 2 buckets: 1.06 MB and 5.85 MB, as DDP reports them)."""


def ddp_bucket_calls(nbytes: float) -> int:
    """All-reduce calls DDP makes per step for ``nbytes`` of gradients (one per bucket, default caps;
    parameters are not split across buckets, so a bucket may overflow by one parameter: not counted)."""
    if nbytes <= 0:
        return 0
    rest = max(nbytes - DDP_FIRST_BUCKET_BYTES, 0.0)
    return 1 + -int(-rest // DDP_BUCKET_BYTES)


def ddp_all_reduce_s(nbytes: float, call_s: float, per_byte_s: float) -> float:
    """Seconds charged to a block's ``nbytes`` of gradients in DDP's all-reduce: their bytes, and their
    share of the 25 MiB buckets' calls (``call_s`` each). Before, each block was charged a call of its
    own: ten calls for gpt-deep's 10 blocks where DDP makes two, 1.2-2.1 ms each on the CPU's gloo
    (``bench_predict_cpu.py``'s in-step fit); the step's unamortised calls are
    :data:`DDP_EDGE_CALLS` (:func:`dp_edges`)."""
    return nbytes * (per_byte_s + call_s / DDP_BUCKET_BYTES)


def post_step_affine(collective: CollectiveFn, kind: str, group: CommGroup | None, precision: str
                     ) -> tuple[float, float]:
    """ZeroRedundancyOptimizer broadcasts every rank's updated fp32 partition after the step, which
    nothing overlaps; timed as an all-gather of the stage's parameters (the same bytes reach every
    rank); other kinds send nothing after the step."""
    if group is None or kind != LoweringKind.ZERO1:
        return 0.0, 0.0
    per = dp_payload_bytes_per_param(Collective.BROADCAST, precision)
    return affine_fit(lambda n: collective(Collective.ALL_GATHER, per * n, group))


def exposed_dp(kind: str, zero3: bool, pipelined: bool, fwd: float, bwd: float, dp: DPComm, g: int,
               reduce_each: bool = False, loss: float = OVERLAP_COMPUTE_LOSS) -> tuple[float, float]:
    """``(exposed per micro-batch, exposed per step)`` seconds of the data-parallel collectives of one
    block of segment ``g`` (forward ``fwd`` and backward ``bwd`` seconds per micro-batch), as the
    runtime runs them; each overlapped by :func:`estimate_overlapped_time` (the compute they run
    beside is slowed while they do):

    - FSDP2, whalepy's own accumulation loop (no pipeline): the block's all-gather runs one block
      ahead, beside the previous block's forward, every micro-batch (FSDP2 reshards after backward),
      and under ZeRO-3 again beside the next block's backward; its reduce-scatter, in the last
      micro-batch only (``set_requires_gradient_sync``), beside the next block's backward; with
      ``reduce_each`` (``StagePlan.reduce_every_microbatch``) in every micro-batch;
    - FSDP2 under ``torch.distributed.pipelining``: the stage keeps parameters gathered after
      backward (``set_reshard_after_backward(False)``), so below ZeRO-3 each block is gathered once per
      step, beside the first forward, and under ZeRO-3 once per micro-batch beside the backward; all
      reduce-scatters run after the last backward (``PipelineStage``'s ``REDUCE_GRAD`` action), exposed;
    - DDP (with or without ZeroRedundancyOptimizer): the gradient's all-reduce, in 25 MiB buckets (each
      block charged its bytes and its share of the buckets' calls, :func:`ddp_all_reduce_s`), beside
      the next block's backward in the last micro-batch (``no_sync`` before).

    ``loss`` is the device's share of compute lost beside a collective (``overlap_loss``: 1 on CPU ranks,
    where nothing hides)."""

    def ov(compute: float, comm: float) -> float:
        return estimate_overlapped_time(compute, comm, loss=loss)

    ag, rs = dp.all_gather[g], dp.reduce_scatter[g]
    if kind == LoweringKind.FSDP and not pipelined:
        xb = ag if zero3 else 0.0
        if reduce_each:
            return ov(fwd, ag) - fwd + ov(bwd, xb + rs) - bwd, 0.0
        return ov(fwd, ag) - fwd + ov(bwd, xb) - bwd, ov(bwd, xb + rs) - ov(bwd, xb)
    if kind == LoweringKind.FSDP:
        if zero3:
            return ov(bwd, ag) - bwd, rs
        return 0.0, ov(fwd, ag) - fwd + rs
    if kind in (LoweringKind.DDP, LoweringKind.ZERO1):
        return 0.0, ov(bwd, dp.all_reduce[g]) - bwd
    return 0.0, 0.0


def dp_edges(kind: str, zero3: bool, pipelined: bool, dp: DPComm, reduce_each: bool = False,
             loss: float = OVERLAP_COMPUTE_LOSS) -> tuple[float, float]:
    """``(per micro-batch, per step)`` collectives with nothing to hide behind: a chunk's first block's
    gathers, and the last block's gradient reduction (see :func:`exposed_dp`). DDP's last bucket: the
    calls its buckets do not amortise (:data:`DDP_EDGE_CALLS`), and the last block's bytes beyond the
    ``loss`` share of them its row in :func:`exposed_dp` charged (on CPU ranks, ``loss`` 1, none: the
    rows charge every byte once)."""
    ag, rs = dp.all_gather[dp.rep], dp.reduce_scatter[dp.rep]
    ar = DDP_EDGE_CALLS * dp.all_reduce_call + (1.0 - loss) * dp.all_reduce[dp.rep]
    if kind == LoweringKind.FSDP and not pipelined:
        if reduce_each:
            return ag * (2 if zero3 else 1) + rs, 0.0
        return ag * (2 if zero3 else 1), rs
    if kind == LoweringKind.FSDP:
        return (ag, 0.0) if zero3 else (0.0, ag)
    if kind in (LoweringKind.DDP, LoweringKind.ZERO1):
        return 0.0, ar
    return 0.0, 0.0
