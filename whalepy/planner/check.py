"""A plan checked against the model it will lower: what ``Plan.load(path, model=...)``, ``whalepy show
--check`` and ``parallelize(plan=...)`` run, so that a hand-edited plan fails with one line before any
lowering, instead of being lowered wrong (an annotation ignored) or failing inside torch.

Checks, each a :class:`~whalepy.PlanError` naming the block / module / annotation and the fix:

- the model fingerprint (module paths and parameter shapes) is the plan's;
- the plan's blocks are the model's blocks, each once, in model order across the pipeline stages;
- in every stage with TP above 1, the blocks that split at that degree
  (:func:`whalepy.ir.rules.tp_splits`, the planner's rule) have their tensor-parallel rules in the
  plan, and the others (shapes that do not divide by the degree) have none: they run whole;
- every TP rule names a module of the model that whalepy's pattern pass found with that style;
- the plan honours the model's annotations (``split``, ``replicate``, ``stage``, ``cluster(gpu=...)``).

Stale costs (a plan whose decisions were edited after its costs were computed) are checked by
:func:`check_costs`, from the hash :attr:`whalepy.Plan.costs_for` records.
"""

from __future__ import annotations

from typing import Any

from whalepy.errors import ArgumentError, PlanError
from whalepy.ir.types import TPStyle
from whalepy.ir.plan import Plan

__all__ = ["check_against", "check_plan", "check_plan_cluster", "check_costs", "default_example_inputs"]

_REPLAN = "re-plan with whalepy.plan() / `whalepy plan`, or undo the edit"


def check_against(plan: Plan, model: Any = None, *, example_inputs: Any = None, profile: Any = None) -> None:
    """:meth:`Plan.check_against`: profile ``model`` (unless its ``profile`` is given) and :func:`check_plan`."""
    if profile is None:
        from whalepy.frontend.checks import check_model
        from whalepy.frontend.profile import profile as build

        check_model(model, "Plan.load(model=...)")
        inputs = example_inputs if example_inputs is not None else default_example_inputs(plan, model)
        profile = build(model, inputs, sequence_parallel=any(r.style is TPStyle.SEQUENCE
                                                             for r in plan.tensor_parallel))
    check_plan(plan, profile, model)


def default_example_inputs(plan: Plan, model: Any) -> tuple:
    """Token ids of the plan's sequence length, for a model that starts with an embedding."""
    import torch

    from whalepy.frontend.checks import first_embedding

    if plan.seq_len is None or first_embedding(model) is None:
        raise ArgumentError(
            f"checking a plan against {type(model).__name__} needs its example inputs: pass "
            "example_inputs=(...) (the ones the plan was made with), or profile=whalepy.profile(model, inputs)")
    return (torch.zeros(1, plan.seq_len, dtype=torch.long),)


def check_costs(plan: Plan) -> None:
    if plan.costs_stale:
        raise PlanError(
            f"the plan's predicted costs are stale: its decisions (stages, degrees, blocks, batch shares) were "
            f"changed after the costs were computed (decision hash {plan.decision_hash()} != {plan.costs_for}); "
            "re-run `whalepy plan`, or cost this layout with `whalepy estimate` / whalepy.estimate()")


def _pipeline_order(plan: Plan) -> list[tuple[str, int]]:
    """``(block name, pipeline stage)`` in execution order (chunk ``j`` of stage ``s`` is ``s + j*pp``)."""
    pp, out = plan.pp_degree, []
    chunks: dict[int, list[str]] = {}
    for s in plan.stages:
        start = 0
        for j, n in enumerate(s.chunk_sizes or (len(s.blocks),)):
            chunks[s.index + j * pp] = [b.name for b in s.blocks[start:start + n]]
            start += n
    for k in sorted(chunks):
        out += [(name, k) for name in chunks[k]]
    return out


def check_plan(plan: Plan, profile: Any, model: Any = None) -> None:
    """Raise :class:`PlanError` where ``plan`` cannot lower ``profile``'s model as planned."""
    if plan.model_fingerprint != "unchecked":
        plan.check_model(profile.fingerprint)
    _check_blocks(plan, profile)
    _check_tensor_parallel(plan, profile, model)
    _check_annotations(plan, profile)


def _check_blocks(plan: Plan, profile: Any) -> None:
    names = [b.name for b in profile.blocks]
    order = [n for n, _ in _pipeline_order(plan)]
    unknown = [n for n in order if n not in set(names)]
    if unknown:
        raise PlanError(f"the plan has block {unknown[0]!r}, which {profile.model_name} does not have (its "
                        f"blocks: {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}); {_REPLAN}")
    missing = [n for n in names if n not in set(order)]
    if missing:
        raise PlanError(f"the plan leaves out block(s) {', '.join(missing[:4])} of {profile.model_name}; every "
                        f"block must be in exactly one stage: add it back, or {_REPLAN}")
    if order != names:
        i = next(i for i, (a, b) in enumerate(zip(order, names)) if a != b)
        raise PlanError(f"the plan runs block {order[i]!r} where {profile.model_name} runs {names[i]!r}: "
                        f"pipeline stages must hold the blocks in model order; {_REPLAN}")


def _check_tensor_parallel(plan: Plan, profile: Any, model: Any) -> None:
    found = {(r.module, r.style) for b in profile.blocks for r in b.tp_rules}
    parts = {r.module: r.parts for b in profile.blocks for r in b.tp_rules if r.style is TPStyle.COLWISE}
    copies = {r.module for b in profile.blocks for r in b.tp_rules if r.copy_output}
    pairs = {r.module for b in profile.blocks for r in b.tp_rules if r.feeds_rowwise}
    # a profile made without sequence_parallel=True has no SEQUENCE rules to compare the plan's with
    sequence_profiled = any(st is TPStyle.SEQUENCE for _, st in found)
    modules = dict(model.named_modules()) if model is not None else None
    for rule in plan.tensor_parallel:
        if modules is not None and rule.module not in modules:
            raise PlanError(f"TP rule {rule.style.value} on {rule.module!r}: the model has no such module; "
                            f"{_REPLAN}")
        if rule.style is TPStyle.SEQUENCE and not sequence_profiled:
            continue
        if (rule.module, rule.style) not in found:
            styles = sorted(st.value for m, st in found if m == rule.module)
            raise PlanError(
                f"TP rule {rule.style.value} on {rule.module!r} is not a pattern whalepy found in the model "
                f"({'it found ' + ', '.join(styles) if styles else 'no TP pattern on that module'}); {_REPLAN}")
        if rule.style is TPStyle.COLWISE and rule.parts != parts.get(rule.module, 1):
            raise PlanError(
                f"TP rule colwise on {rule.module!r} shards its output as {rule.parts} fused piece(s), but the "
                f"model splits it into {parts.get(rule.module, 1)}; sharding it so would pair the wrong halves "
                f"on each rank; {_REPLAN}")
        if rule.feeds_rowwise and rule.module not in pairs:
            raise PlanError(f"TP rule colwise on {rule.module!r} keeps its output sharded (feeds_rowwise), but no "
                            f"row-parallel layer reads it in the model; {_REPLAN}")
        if rule.style is not TPStyle.SEQUENCE and rule.copy_output != (rule.module in copies):
            raise PlanError(
                f"TP rule {rule.style.value} on {rule.module!r} has copy_output={rule.copy_output}, but the model "
                f"{'modifies' if rule.module in copies else 'does not modify'} that module's output in place; "
                f"{_REPLAN}")
    from whalepy.ir.rules import tp_splits

    ruled = {r.module for r in plan.tensor_parallel if r.style is not TPStyle.REPLICATE}
    for s in plan.stages:
        if s.tp_degree == 1:
            continue
        for name in s.block_names:
            block = profile.block(name)
            own = {r.module for r in block.tp_rules if r.style is not TPStyle.REPLICATE}
            if not tp_splits(block, s.tp_degree):
                # the planner runs this block whole on every rank of the TP group (no pattern, or shapes
                # that do not divide by the degree: GPT-2's 50257-token embedding); a rule for it would
                # shard what cannot be sharded
                if own & ruled:
                    raise PlanError(
                        f"stage {s.index} runs block {name!r} with TP {s.tp_degree}, but its shapes (heads, "
                        f"features, vocabulary) divide only by {', '.join(map(str, block.tp_degrees))}, so it "
                        f"must run whole, and the plan has a tensor-parallel rule for it "
                        f"({sorted(own & ruled)[0]}); {_REPLAN}")
                continue
            if not own & ruled:
                raise PlanError(
                    f"stage {s.index} has TP {s.tp_degree} but the plan has no tensor-parallel rule for block "
                    f"{name!r} (e.g. {sorted(own)[0]}), so it would run unsplit; {_REPLAN}")


def _stage_types_match(types: tuple[str, ...], gpu: str) -> bool:
    from whalepy.planner.search import _gpu_matches

    return all(_gpu_matches(t, gpu) for t in types)


def _check_annotations(plan: Plan, profile: Any) -> None:
    where = {name: k for name, k in _pipeline_order(plan)}
    stage_of = {b.name: s for s in plan.stages for b in s.blocks}
    annotated: dict[int, set[int]] = {}
    for b in profile.blocks:
        a, s = b.annotations, stage_of[b.name]
        src = a.sources[0] if a.sources else b.name

        def refuse(what: str) -> PlanError:
            return PlanError(f"the plan does not honour {src}: {what}; {_REPLAN}, or change the annotation")

        if a.split and s.tp_degree != a.split:
            raise refuse(f"block {b.name} runs with TP {s.tp_degree}, split({a.split}) asks for {a.split}")
        if a.split == 0 and s.tp_degree == 1:
            raise refuse(f"block {b.name} runs with TP 1, split() asks for TP above 1")
        if a.replicate and plan.dp_degree != a.replicate:
            raise refuse(f"the plan has {plan.dp_degree} data-parallel replicas, replicate({a.replicate}) asks "
                         f"for {a.replicate}")
        if a.replicate == 0 and s.tp_degree != 1:
            raise refuse(f"block {b.name} runs with TP {s.tp_degree}, replicate() asks for TP 1")
        if a.cluster_gpu and not _stage_types_match(s.device_types, a.cluster_gpu):
            raise refuse(f"block {b.name} runs on {', '.join(sorted(set(s.device_types)))}, not {a.cluster_gpu}")
        if a.stage is not None:
            annotated.setdefault(a.stage, set()).add(where[b.name])
    seen: set[int] = set()
    for k in sorted(annotated):
        ks = annotated[k]
        if len(ks) > 1 or ks & seen:
            raise PlanError(f"the plan does not honour the model's stage() scopes: stage scope {k} is split "
                            f"over pipeline stages {sorted(ks)} or shares one with another scope; {_REPLAN}")
        seen |= ks


def check_plan_cluster(plan: Plan, cluster_spec: Any) -> None:
    """A given plan was made for this cluster spec: as many ranks, each of the device type the plan put
    there (checked with or without a launch, before anything is lowered; ``parallelize`` and ``whalepy check``)."""
    if cluster_spec is None or not hasattr(cluster_spec, "rank_devices"):
        return
    spec_types = tuple(d.device.name for d in cluster_spec.rank_devices())
    if len(spec_types) != plan.world_size:
        raise PlanError(f"the plan is for {plan.world_size} devices but the cluster spec has {len(spec_types)}; "
                        "pass the cluster spec the plan was made for, or re-plan for this one")
    bad = next((r for r, (a, b) in enumerate(zip(spec_types, plan.rank_device_types)) if a != b), None)
    if bad is not None:
        raise PlanError(f"the plan puts a {plan.rank_device_types[bad]} on rank {bad}, the cluster spec has a "
                        f"{spec_types[bad]} there: the plan was made for another cluster; re-plan for this one")
