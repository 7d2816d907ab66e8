"""Human-readable views of a Plan: ``print(plan)`` / ``plan.summary()`` and ``plan.explain()``."""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import TYPE_CHECKING

from whalepy.ir.types import GIB

if TYPE_CHECKING:
    from whalepy.ir.plan import Plan



def compress_names(names: list[str] | tuple[str, ...]) -> str:
    """``["h.0", "h.1", "h.2", "head"]`` -> ``"h.0-2, head"``: runs of consecutive numbered names."""
    out: list[str] = []
    run: list[tuple[str, int, str]] = []

    def flush() -> None:
        if not run:
            return
        if len(run) == 1:
            out.append(run[0][2])
        else:
            out.append(f"{run[0][2]}-{run[-1][1]}")
        run.clear()

    for n in names:
        m = re.fullmatch(r"(.*?)(\d+)", n)
        if m and run and run[-1][0] == m.group(1) and run[-1][1] + 1 == int(m.group(2)):
            run.append((m.group(1), int(m.group(2)), n))
            continue
        flush()
        if m:
            run.append((m.group(1), int(m.group(2)), n))
        else:
            out.append(n)
    flush()
    return ", ".join(out)


def compress_ranks(ranks: list[int] | tuple[int, ...]) -> str:
    """``[0, 1, 2, 3, 8, 9]`` -> ``"0-3,8-9"``."""
    rs = sorted(ranks)
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts)


def format_seconds(x: float) -> str:
    if math.isinf(x):
        return "inf"
    if x >= 1:
        return f"{x:.3g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} us"


def format_rate(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_plan(plan: Plan, *, batch_source: str | None = None) -> str:
    """The plan as text; ``batch_source``: where its global batch came from, said beside it (the CLI's
    default batch)."""
    c = plan.cost
    types = Counter(plan.rank_device_types)
    head = (f"Plan for {plan.model_name} on {plan.world_size} devices "
            f"({', '.join(f'{n} x{k}' for n, k in types.items())}): "
            f"pp={plan.pp_degree} dp={plan.dp_degree} tp={'/'.join(map(str, sorted(set(plan.tp_degrees))))}, "
            f"{plan.schedule.value}" + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
            + f", {plan.num_microbatches} micro-batches, global batch {plan.global_batch}"
            + (f" ({batch_source})" if batch_source else "") + ", "
            f"{plan.precision.value}")
    shares = sorted(set(plan.batch_shares))
    lines = [head]
    if len(shares) == 1:
        lines.append(f"  batch: {shares[0]} samples per replica, micro-batch {shares[0] // plan.num_microbatches}")
    else:
        lines.append("  batch shares per replica: " + ", ".join(map(str, plan.batch_shares)))
    lines.append("  " + step_choices(plan))
    rows = [("stage", "blocks", "devices", "tp", "dp", "dp wrapper", "ckpt", "offload", "compute", "comm",
             "bubble", "memory / usable")]
    for s in plan.stages:
        devs = Counter(s.device_types)
        dev = ", ".join(f"{n} x{k * s.tp_degree}" for n, k in devs.items()) + f" [{compress_ranks(s.all_ranks)}]"
        ck = sum(b.checkpoint for b in s.blocks)
        tiers = sorted({f"opt:{b.optimizer_tier.value}" for b in s.blocks if b.optimizer_tier.value != "gpu"}
                       | {f"params:{b.param_tier.value}" for b in s.blocks if b.param_tier.value != "gpu"}
                       | {"act:cpu" for b in s.blocks if b.activation_offload}
                       | {"ckpt:cpu" for b in s.blocks if getattr(b, "checkpoint_offload", False)}
                       | {f"tiles:{b.tiles}" for b in s.blocks if getattr(b, "tiles", 1) > 1}
                       | ({"reduce:every-mb"} if getattr(s, "reduce_every_microbatch", False) else set()))
        k = s.cost
        mem = (f"{k.memory_bytes / GIB:.1f} / {k.capacity_bytes / GIB:.1f} GiB" if k.capacity_bytes else "-")
        rows.append((str(s.index), compress_names(s.block_names), dev, str(s.tp_degree), str(s.dp_degree),
                     stage_lowering(plan, s), f"{ck}/{len(s.blocks)}", " ".join(tiers) or "-",
                     format_seconds(k.compute_s), format_seconds(k.comm_s), format_seconds(k.bubble_s), mem))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("  (compute and comm per micro-batch; bubble per step)")
    if any(r[5].endswith("*") for r in rows[1:]):
        from whalepy.ir.rules import LOWERED_NOTE

        lines.append(f"  ({LOWERED_NOTE})")
    lines += _memory_lines(plan)
    tok = f", {format_rate(c.tokens_per_s)} tokens/s" if c.tokens_per_s else ""
    lines.append(f"  step time {format_seconds(c.step_time_s)}: {format_rate(c.samples_per_s)} samples/s{tok}, "
                 f"{c.model_tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {100 * c.mfu:.1f}%")
    if len(types) > 1:
        for name, busy in c.busy_by_device_type:
            blocks = [b for st in plan.stages if name in st.device_types for b in st.block_names]
            idle = max(0.0, c.step_time_s - busy)
            lines.append(f"  {name}: {_samples_by_stage(plan, name)}, blocks {compress_names(blocks)}, "
                         f"busy {format_seconds(busy)}, idle {format_seconds(idle)} per step")
    sv = plan.solver
    gap = "n/a" if math.isnan(sv.mip_gap) else f"{100 * sv.mip_gap:.2g}%"
    lines.append(f"  solver {sv.solver} ({sv.status}), {sv.num_candidates} candidates, solve time "
                 f"{sv.solve_time_s:.2f} s, MIP gap {gap}")
    for n in plan.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def step_choices(plan: Plan) -> str:
    """The optimizer implementation and compiled blocks the plan lowers, on one line."""
    impl = "fused (torch's fused kernel of the user's optimizer class)" if plan.optimizer_impl.value == "fused" \
        else "as given (the factory's optimizer exactly)"
    return f"optimizer: {impl}; compiled blocks: {'yes' if plan.compile else 'no'}"


def stage_lowering(plan: Plan, stage) -> str:  # type: ignore[no-untyped-def]
    """The data-parallel wrapper the runtime lowers ``stage`` onto (:func:`whalepy.ir.rules.lowering_label`)."""
    from whalepy.ir.rules import lowering_label, offloads_to_host

    offload = any(offloads_to_host(b.param_tier, b.optimizer_tier) for b in stage.blocks)
    return lowering_label(stage.zero_stage, plan.dp_degree, tp=stage.tp_degree, pp=plan.pp_degree, offload=offload)


def block_tiers(stage) -> str:  # type: ignore[no-untyped-def]
    """Each block's (parameter / optimizer) tier, runs of equal tiers compressed, with the prefetch depth
    of blocks whose parameters are off the device."""
    runs: list[list] = []  # type: ignore[type-arg]
    for b in stage.blocks:
        tier = f"{b.param_tier.value}/{b.optimizer_tier.value}"
        depth = getattr(b, "prefetch_depth", 1)
        if b.param_tier.value != "gpu":
            tier += f" prefetch {depth}"
        if getattr(b, "tiles", 1) > 1:
            tier += f" tiles {b.tiles}"
        if runs and runs[-1][0] == tier:
            runs[-1][1].append(b.name)
        else:
            runs.append([tier, [b.name]])
    return "; ".join(f"{compress_names(names)} {tier}" for tier, names in runs)


def _samples_by_stage(plan: Plan, device_type: str) -> str:
    """Which stages a GPU type runs and how many of each step's samples it processes in them:
    ``"stage 0: all 512 samples"`` when a pipeline puts one type per stage, ``"stages 0-3: 320/512
    samples"`` when replicas of one stage are of several types."""
    by_share: dict[int, list[int]] = {}
    for st in plan.stages:
        share = sum(b for b, t in zip(plan.batch_shares, st.device_types) if t == device_type)
        if share:
            by_share.setdefault(share, []).append(st.index)
    parts = []
    for share, stages in by_share.items():
        amount = f"all {share} samples" if share == plan.global_batch else f"{share}/{plan.global_batch} samples"
        parts.append(f"stage{'s' if len(stages) > 1 else ''} {compress_ranks(stages)}: {amount}")
    return "; ".join(parts)


MEMORY_ITEMS = (
    ("params", "the stage's parameters each device holds at the peak: its shard (ZeRO-3) or all of them, "
               "in the training precision and, where kept, their fp32 master copy's share"),
    ("grads", "gradients held at the peak: none with one micro-batch and no pipeline (they appear as "
              "backward frees activations), else the fp32 / 16-bit gradients (sharded under ZeRO-2/3)"),
    ("optimizer", "Adam's fp32 master weights, momentum and variance (12 bytes per parameter), divided "
                  "by the data-parallel degree under ZeRO-1/2/3; 0 where they live on the host"),
    ("activations", "tensors saved for backward by the micro-batches in flight (1F1B holds S - s on "
                    "stage s), plus one recomputed block, autocast's fp32 copies of block inputs, and on "
                    "the last stage the logits and the loss's fp32 log-probabilities (loss)"),
    ("buffers", "what the data-parallel wrapper and autocast hold beside the states: FSDP2's working "
                "set (an unsharded block gradient before its reduce-scatter; under ZeRO-3 also the running "
                "block's gathered parameters and the next one's, prefetched), "
                "FSDP2's gathered 16-bit parameters below ZeRO-3, unsharded fp32 gradients accumulated "
                "over micro-batches, autocast's 16-bit weight copies"),
    ("reserve", "device memory the allocator cannot use: the CUDA context (0.5 GiB), 128 MiB of NCCL "
                "buffers per parallel axis, and 5% of the allocated peak for fragmentation"),
    ("margin", "device memory left unplanned for the memory model's own error (memory_margin, default 5% "
               "of the device)"),
    ("host", "host memory per GPU: offloaded parameters, gradients, optimizer states and activations"),
    ("NVMe", "optimizer states (and parameters) in files per GPU (ZeRO-Infinity)"),
)
"""Each memory item of the plan's text and page: what it holds and how it is counted (docs/cost_model.md,
"The plan's memory items", has the formulas)."""


def _activation_items(k) -> str:  # type: ignore[no-untyped-def]
    parts = ([f"{k.inflight_microbatches} micro-batch{'es' if k.inflight_microbatches > 1 else ''} in flight"]
             if k.inflight_microbatches and k.activation_bytes else [])
    parts += [f"loss {k.loss_bytes / GIB:.2f}"] if k.loss_bytes >= 0.005 * GIB else []
    return f" ({'; '.join(parts)})" if parts else ""


def _buffer_items(k) -> str:  # type: ignore[no-untyped-def]
    items = [("FSDP2 working set", k.working_set_bytes), ("gathered params", k.gathered_params_bytes),
             ("fp32 grad accumulation", k.grad_accum_bytes), ("autocast weight copies", k.autocast_copy_bytes)]
    shown = [f"{name} {b / GIB:.2f}" for name, b in items if b]
    return f" ({', '.join(shown)})" if shown else ""


def _margin(k) -> str:  # type: ignore[no-untyped-def]
    """``, margin 4.00 (5% of 80 GiB)``: the memory left unplanned (``PlannerOptions.memory_margin``)."""
    if not k.margin_bytes:
        return ""
    device = k.capacity_bytes + k.reserve_bytes + k.margin_bytes
    return f", margin {k.margin_bytes / GIB:.2f} ({100 * k.margin_bytes / device:.0f}% of {device / GIB:.0f} GiB)"


def _memory_lines(plan: Plan) -> list[str]:
    """Per stage: memory by kind on the tightest device, and exposed communication by kind."""
    out = []
    for s in plan.stages:
        k = s.cost
        parts = (k.params_bytes, k.grads_bytes, k.optimizer_bytes, k.activation_bytes, k.buffer_bytes)
        if not any(parts):
            continue  # a plan written before the breakdown existed
        host = (f"; host {k.cpu_bytes / GIB:.2f}" if k.cpu_bytes else "") + (
            f"; NVMe {k.nvme_bytes / GIB:.2f}" if k.nvme_bytes else "")
        out.append(f"  stage {s.index} memory GiB: params {k.params_bytes / GIB:.2f}, grads {k.grads_bytes / GIB:.2f}, "
                   f"optimizer {k.optimizer_bytes / GIB:.2f}, activations {k.activation_bytes / GIB:.2f}"
                   f"{_activation_items(k)}, buffers {k.buffer_bytes / GIB:.2f}{_buffer_items(k)}; "
                   f"reserve {k.reserve_bytes / GIB:.2f}{_margin(k)}{host}")
        off = ""
        if any(b.param_tier.value != "gpu" or b.optimizer_tier.value != "gpu" for b in s.blocks):
            off = f"; offload (tiers {block_tiers(s)}) exposed {format_seconds(k.offload_s)} per step"
        out.append(f"  stage {s.index} exposed comm: TP {format_seconds(k.tp_comm_s)}, "
                   f"p2p {format_seconds(k.p2p_s)}, DP {format_seconds(k.dp_comm_s)} per micro-batch; gradient sync {format_seconds(k.grad_sync_s)} per step{off}")
    return out


def format_explanation(plan: Plan) -> str:
    lines = [f"Chosen: pp={plan.pp_degree} dp={plan.dp_degree} tp={'/'.join(map(str, sorted(set(plan.tp_degrees))))} "
             f"M={plan.num_microbatches} {plan.schedule.value}: {format_seconds(plan.cost.step_time_s)} per step"]
    if not plan.alternatives:
        lines.append("  no alternatives recorded")
    for a in plan.alternatives:
        if math.isinf(a.step_time_s):  # never costed: pruned by its bound, or not allowed
            lines.append(f"  {a.description}: {a.reason}")
        else:
            lines.append(f"  {a.description}: {format_seconds(a.step_time_s)} -- {a.reason}")
    lines.append("Memory items (per device, the tightest replica of each stage):")
    lines += [f"  {name}: {what}" for name, what in MEMORY_ITEMS]
    return "\n".join(lines)
