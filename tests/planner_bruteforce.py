"""A brute force over the planner's whole space, sharing no pruning with it, and random small instances.

``brute_force`` walks every outer candidate (each schedule enumerated on its own, so the search's rule
that drops GPipe where 1F1B ties it plays no part), every contiguous split of the blocks into virtual
stages, every split of every chunk's blocks per segment into checkpointed (with the input on the device or in
host memory), activation-offloaded and plain ones and every state option a stage's group can hold (including those :func:`costing._undominated`
drops) or mix of them (granular tiers, :attr:`StageCoeffs.families`), costs each stage with the planner's own :func:`evaluate_stage` and every combination of stages
with :func:`step_time`, keeping those whose nodes hold their host and NVMe bytes (:func:`node_fits`). No lower bound, no
incumbent, no Pareto front, no dominance: only identical per-stage outcomes are merged, which loses
nothing. What it shares with the planner is the definition of the space and of the cost.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import numpy as np

from whalepy.cost_models.memory import estimate_device_bytes_for_usable
from whalepy.ir.plan import Schedule
from whalepy.planner import make_options, resolve_optimizer_impl
from whalepy.planner.costing import (
    CostContext,
    build_coefficients,
    chunk_counts_from_sizes,
    evaluate_stage,
    node_fits,
    stage_checkpoint_offloadable,
    stage_offloadable,
    step_time,
)
from whalepy.planner.search import enumerate_candidates, read_annotations
from whalepy.planner.space import MAX_OPTIONS_PER_STAGE, Hardware, build_segments, build_state_options
from whalepy.planner.synthetic import transformer_profile

from planner_fixtures import as_fp32_capture, cluster, group, tiny_device


def _splits(n: int, k: int):  # type: ignore[no-untyped-def]
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        yield tuple(b[i + 1] - b[i] for i in range(k))


def stage_outcomes(sc, chunks, dp: int, allow_checkpointing: bool,  # type: ignore[no-untyped-def]
                   allow_activation_offload: bool = True,
                   nodes: bool = True, allow_checkpoint_offload: bool = True
                   ) -> set[tuple[float, float, float, bool, float, float]]:
    """``(T_s, Tc_s, X_s, fits, host bytes, NVMe bytes)`` of every choice of one stage: checkpointed,
    activation-offloaded and checkpointed-with-the-input-on-the-host counts per segment of each chunk,
    and state option (``nodes`` False: nothing is off the device, the bytes are left 0 so that equal
    outcomes merge)."""
    out = set()
    G = len(chunks[0])
    off_ok = set(stage_offloadable(sc)) if allow_activation_offload else set()
    ck_ok = set(stage_checkpoint_offloadable(sc)) if allow_checkpoint_offload else set()
    per = [[(c, o, w) for c in (range(n + 1) if allow_checkpointing else (0,))
            for o in (range(n - c + 1) if g in off_ok else (0,))
            for w in (range(c + 1) if g in ck_ok else (0,))] for row in chunks for g, n in enumerate(row)]
    for split in itertools.product(*per):
        rows = [[split[k * G + g][0] for g in range(G)] for k in range(len(chunks))]
        offs = [[split[k * G + g][1] for g in range(G)] for k in range(len(chunks))]
        ckoffs = [[split[k * G + g][2] for g in range(G)] for k in range(len(chunks))]
        # every option the stage's groups can hold, dominated ones included (not one only a mix may
        # use), and every mix of a family (granular tiers) on a one-chunk stage
        choices = [o for o in sc.sync if not o.beside_offload] + (_mixes(sc, chunks[0]) if len(chunks) == 1 else [])
        for o in choices:
            ev = evaluate_stage(sc, chunks, rows, o, dp=dp, chunk_offs=offs, chunk_ckoffs=ckoffs)
            off = (ev.cells[0].cpu_bytes, ev.cells[0].nvme_bytes) if nodes else (0.0, 0.0)
            out.add((ev.time_s, ev.chunk_time_s, ev.tail_s, ev.fits, *off))
    return out


def _mixes(sc, counts) -> list:  # type: ignore[no-untyped-def, type-arg]
    """Every split of a stage's blocks per segment over 2 to MAX_OPTIONS_PER_STAGE options of one of its
    families, each option with a block, not all of them only-in-a-mix options."""
    out = []
    for fam in sc.families:
        for r in range(2, min(MAX_OPTIONS_PER_STAGE, len(fam)) + 1):
            for opts in itertools.combinations(fam, r):
                if all(o.beside_offload for o in opts):
                    continue
                per_seg = [[c for c in itertools.product(range(n + 1), repeat=r) if sum(c) == n] for n in counts]
                for split in itertools.product(*per_seg):
                    parts = tuple((o, tuple(split[g][i] for g in range(len(counts)))) for i, o in enumerate(opts))
                    tied = sum(1 for _, n in parts if any(n[g] for g in sc.tied_segments))
                    if all(any(n) for _, n in parts) and tied <= 1:
                        out.append(parts)
    return out


def candidate_optimum(cc, allow_checkpointing: bool = True,  # type: ignore[no-untyped-def]
                      allow_activation_offload: bool = True,
                      allow_checkpoint_offload: bool = True) -> tuple[float, float]:
    """``(best feasible step time, best step time ignoring memory)`` of one candidate, by enumeration
    (feasible: every device, and every node's host memory and NVMe).

    Every combination of the stages' outcomes is costed: the stage with the most outcomes as one numpy
    array per combination of the others (``step_time`` is a linear form, the same float operations on
    an array), the others one by one. A stage's outcomes depend only on its own blocks per segment, so
    they are enumerated once per distinct count, not once per split that repeats it."""
    cand = cc.candidate
    S, v = cand.num_stages, cand.virtual_stages
    best_fit, best_any = math.inf, math.inf
    outcomes: dict[tuple[int, tuple[tuple[int, ...], ...]], list] = {}  # type: ignore[type-arg]
    for sizes in _splits(cc.num_blocks, cand.num_virtual):
        rows = chunk_counts_from_sizes(cc, sizes)
        per_stage = []
        for s in range(S):
            key = (s, tuple(tuple(rows[s + k * S]) for k in range(v)))
            if key not in outcomes:
                outcomes[key] = sorted(stage_outcomes(cc.stages[s], [list(r) for r in key[1]], cand.dp,
                                                      allow_checkpointing, allow_activation_offload,
                                                      bool(cc.nodes), allow_checkpoint_offload))
            per_stage.append(outcomes[key])
        fit, any_ = _best_combination(cc, per_stage)
        best_fit, best_any = min(best_fit, fit), min(best_any, any_)
    return best_fit, best_any


def _best_combination(cc, per_stage: list[list[tuple]]) -> tuple[float, float]:  # type: ignore[no-untyped-def, type-arg]
    """``(best feasible, best ignoring memory)`` step time over every combination of one outcome per
    stage (the widest stage vectorised, each combination of the others in turn)."""
    best_fit, best_any = math.inf, math.inf
    if any(not outs for outs in per_stage):
        return best_fit, best_any
    j = max(range(len(per_stage)), key=lambda s: len(per_stage[s]))
    wide = np.array([o[:3] for o in per_stage[j]], dtype=np.float64)
    wide_fits = np.array([o[3] for o in per_stage[j]], dtype=bool)
    others = per_stage[:j] + per_stage[j + 1:]
    for head in itertools.product(*others):
        T = np.maximum(wide[:, 0], max((c[0] for c in head), default=-math.inf))
        Tc = np.maximum(wide[:, 1], max((c[1] for c in head), default=-math.inf))
        X = np.maximum(wide[:, 2], max((c[2] for c in head), default=-math.inf))
        t = step_time(cc, T, Tc, X)
        best_any = min(best_any, float(t.min()))
        if not all(c[3] for c in head):
            continue
        ok = np.flatnonzero(wide_fits & (t < best_fit))
        for i in ok[np.argsort(t[ok], kind="stable")]:
            combo = list(head[:j]) + [per_stage[j][i]] + list(head[j:])
            if node_fits(cc, [c[4] for c in combo], [c[5] for c in combo]):
                best_fit = float(t[i])  # the smallest that fits every node
                break
    return best_fit, best_any


def outer_candidates(ctx: CostContext, global_batch: int, **options):  # type: ignore[no-untyped-def]
    """Every outer candidate of the planner's space, each schedule enumerated separately."""
    opts = make_options(options)
    cons = read_annotations(ctx.profile, ctx.hw)
    seen, out = set(), []
    for sched in opts.schedules:
        one = dataclasses.replace(opts, schedules=(sched,))
        for cand in enumerate_candidates(ctx, global_batch, one, cons, []):
            if cand not in seen:
                seen.add(cand)
                out.append(cand)
    return out, opts


def instance_space(inst):  # type: ignore[no-untyped-def]
    """What the bound tests walk for one random instance: ``(options, cost context, outer candidates,
    segments, state options)``, the context built as the planner builds it."""
    opts = make_options(inst.options)
    ctx = CostContext(inst.profile, Hardware(inst.cluster), precision=opts.precision,
                      sequence_parallel=opts.sequence_parallel,  # the optimizer the planner charges
                      optimizer_impl=resolve_optimizer_impl(inst.cluster, opts.optimizer_impl),
                      memory_margin=opts.memory_margin)
    cands, _ = outer_candidates(ctx, inst.global_batch, **inst.options)
    return (opts, ctx, cands, build_segments(inst.profile),
            build_state_options(opts.zero_stages, opts.allow_offload, opts.precision))


def brute_force(profile, cluster_spec, global_batch: int, **options) -> float:  # type: ignore[no-untyped-def]
    """The fastest feasible step time over the whole space (``inf`` if nothing fits)."""
    opts = make_options(options)
    ctx = CostContext(profile, Hardware(cluster_spec), precision=opts.precision,
                      sequence_parallel=opts.sequence_parallel,  # the optimizer the planner charges
                      optimizer_impl=resolve_optimizer_impl(cluster_spec, opts.optimizer_impl),
                      memory_margin=opts.memory_margin)
    cands, opts = outer_candidates(ctx, global_batch, **options)
    segments = build_segments(profile)
    state = build_state_options(opts.zero_stages, opts.allow_offload, opts.precision)
    best = math.inf
    for cand in cands:
        cc = build_coefficients(ctx, cand, segments, state, mixed_tiers=opts.mixed_tiers)
        best = min(best, candidate_optimum(cc, opts.allow_checkpointing, opts.allow_activation_offload,
                                           opts.allow_checkpoint_offload)[0])
    return best


# -- random instances ---------------------------------------------------------------------------------

DEVICES = ("T4", "V100-32GB", "A100-80GB", "H100-SXM")
LINKS = ("pcie3", "pcie4", "nvlink3")


@dataclasses.dataclass(frozen=True)
class Instance:
    profile: object
    cluster: object
    global_batch: int
    options: dict

    def __repr__(self) -> str:  # what a failing test prints
        p = self.profile
        return (f"Instance({p.model_name}, dtype={p.dtype}, {len(p.blocks)} blocks, "
                f"groups={[(g.name, g.gpu, g.gpus_per_node, g.num_nodes) for g in self.cluster.groups]}, "
                f"batch={self.global_batch}, options={self.options})")


def random_instance(rng: random.Random, *, max_layers: int = 4, max_world: int = 8,
                    fp32_capture: bool | None = None, mixed: bool | None = None) -> Instance:
    """A small transformer on a small cluster: captured in fp32 or bf16, trained in bf16/fp16/fp32, on one
    device type or two, with memory from roomy to too small (some instances fit nothing)."""
    layers = rng.randint(1, max_layers)
    sp = rng.random() < 0.2
    prof = transformer_profile(num_layers=layers, hidden=rng.choice([256, 512, 1024, 2048]),
                               seq_len=rng.choice([128, 512, 1024, 2048]), vocab=rng.choice([8000, 32000, 50257]),
                               num_heads=8, batch=1, name=f"rand{rng.getrandbits(32)}", sequence_parallel=sp)
    if fp32_capture if fp32_capture is not None else rng.random() < 0.5:
        prof = as_fp32_capture(prof)
    need = 16 * prof.total_params  # plain data-parallel model states on one device
    mixed = rng.random() < 0.4 if mixed is None else mixed
    per_node = rng.choice([1, 2, 4])
    nodes = rng.choice([1, 2]) if per_node * 2 <= max_world else 1
    cpu = rng.choice([None, 64])
    specs = [("a", rng.choice(DEVICES), nodes)]
    if mixed:
        other = rng.choice([d for d in DEVICES if d != specs[0][1]])
        specs.append(("b", other, 1))
    groups, custom = [], []
    for name, base, n in specs:
        # sized by what the allocator may use (device memory less the CUDA context, NCCL buffers and
        # fragmentation), so "roomy to too small" is about the model, not the fixed reserve
        usable = need * rng.uniform(0.2, 2.0)
        dev = tiny_device(f"{base}-{rng.getrandbits(24)}", base, estimate_device_bytes_for_usable(usable) / 2**30)
        groups.append(group(name, dev.name, per_node, n, link=rng.choice(LINKS), custom={dev.name: dev},
                            cpu_gb=cpu, net_gbps=rng.choice([25, 100, 400])))
        custom.append(dev)
    c = cluster(*groups, custom=custom)
    # bf16 only where every device type has it (planning bf16 on a T4 or V100 is a PlanError)
    precisions = ["bf16", "fp16", "fp32"] if all(d.supports_bf16 for d in custom) else ["fp16", "fp32"]
    options = dict(precision=rng.choice(precisions), max_microbatches=4,
                   schedules=rng.choice([("1f1b",), ("gpipe", "1f1b"), ("1f1b", "interleaved_1f1b"),
                                         ("gpipe", "1f1b", "interleaved_1f1b")]),
                   zero_stages=rng.choice([(0,), (0, 1), (0, 3), (0, 1, 2, 3)]),
                   allow_offload=rng.random() < 0.3, allow_checkpointing=rng.random() < 0.8,
                   sequence_parallel=sp)
    batch = c.world_size * rng.choice([1, 2, 4])
    # drawn last, so the instances of earlier seeds stay what they were; in a third of them (enumerating
    # the checkpointed inputs' placement multiplies the brute force's work)
    options["allow_checkpoint_offload"] = rng.random() < 0.3
    return Instance(prof, c, batch, options)
