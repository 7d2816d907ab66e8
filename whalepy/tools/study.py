"""``whalepy.study_zero``: which ZeRO stage, at what cost in memory and communication, for a model on a
cluster -- a table, not a search.

For every ZeRO stage 0-3 on all devices as one data-parallel group (and, where every node group has
host memory, with the states offloaded to the host), one :class:`ZeroStudyRow` per model: the per-GPU
model-state, activation and peak memory, the step time, throughput and fit of
:func:`whalepy.estimate_from_profile` (the planner's own costing), and the communication volume per step
of the collectives the runtime issues (:func:`whalepy.planner.runtime_costs.dp_step_payload_bytes`),
split into the bytes each GPU sends over intra-node and inter-node links
(:func:`whalepy.cost_models.communication.estimate_collective_link_bytes`). Nothing is re-derived here.

``measure=True`` also trains a few steps of each row on CPU gloo processes and puts the model-state
bytes each rank holds and the collective bytes counted at its process group next to the prediction
(:mod:`whalepy.tools.study_measure`). Output: :mod:`whalepy.tools.study_format` (table, CSV, plot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from whalepy.errors import WhalepyError
from whalepy.hardware.cluster import ClusterSpec
from whalepy.cost_models.communication import Collective, estimate_collective_link_bytes
from whalepy.ir.plan import Tier
from whalepy.ir.profile import ModelProfile

__all__ = ["STUDY_FAMILIES", "ZeroStudyRow", "study_zero", "zero_study_cases"]

STUDY_FAMILIES: dict[str, tuple[str, ...]] = {
    "mt5": ("mt5-base", "mt5-large", "mt5-xl", "mt5-xxl"),
    "t5": ("t5-v1_1-xl", "t5-v1_1-xxl"),
}
"""``--sizes`` shorthands: the mT5 family (580M to 13B) and T5 v1.1 XL / XXL (whalepy.models.t5)."""


@dataclass(frozen=True, kw_only=True)
class ZeroStudyRow:
    """One (model, ZeRO stage, offload) configuration; bytes are per GPU, communication per step."""

    model: str
    num_params: int
    zero_stage: int
    offload: str | None
    """``"cpu"``: parameters, gradients and optimizer states in host memory (FSDP2 ``CPUOffloadPolicy``)."""
    lowering: str
    """What the runtime lowers it to (``ddp``, ``ddp+zero_redundancy_optimizer``, ``fsdp2``)."""
    dp: int
    global_batch: int
    model_state_bytes: float
    """Parameters, gradients and optimizer states held on the GPU between uses."""
    host_state_bytes: float
    activation_bytes: float
    buffer_bytes: float
    """FSDP2's gathered parameters and gradient buffers, autocast's weight copies."""
    peak_bytes: float
    capacity_bytes: float
    fits: bool
    reason: str
    payload_bytes: dict[str, float]
    """Collective -> payload bytes per step (all-reduce / broadcast: the tensor; all-gather: the gathered
    output; reduce-scatter: the whole input)."""
    intra_node_bytes: float
    """Bytes each GPU sends over intra-node links per step."""
    inter_node_bytes: float
    """Bytes each GPU sends over the network per step."""
    step_time_s: float
    samples_per_s: float
    tflops_per_gpu: float
    measured_state_bytes: float | None = None
    """Held by a rank at the optimizer step (``measure=True``; the largest over ranks)."""
    measured_payload_bytes: dict[str, float] | None = field(default=None)
    """Counted at the process group in one step (``measure=True``; the largest over ranks)."""

    @property
    def label(self) -> str:
        return f"ZeRO-{self.zero_stage}" + (f"+{self.offload}" if self.offload else "")

    @property
    def comm_bytes(self) -> float:
        return sum(self.payload_bytes.values())

    @property
    def measured_comm_bytes(self) -> float | None:
        return None if self.measured_payload_bytes is None else sum(self.measured_payload_bytes.values())


def zero_study_cases(cluster: ClusterSpec, *, offload: bool = True) -> list[tuple[int, str | None]]:
    """``(zero stage, offload)`` rows: stages 0-3 on the GPU and, when ``offload`` and every node group
    has host memory (``cpu_memory_gb``), ZeRO-2 and ZeRO-3 with the states on the host. (The runtime
    lowers a host tier onto FSDP2 at any stage, so ZeRO-0/1 with offload would be ZeRO-2 + offload.)"""
    from whalepy.ir.rules import state_option_error

    cases: list[tuple[int, str | None]] = [(z, None) for z in range(4)]
    if offload and all(g.cpu_memory_bytes for g in cluster.groups):
        cases += [(z, "cpu") for z in (2, 3) if state_option_error(z, Tier.CPU, Tier.CPU) is None]
    return cases


def study_zero(models: Sequence[str | ModelProfile] | str | ModelProfile, cluster: ClusterSpec | str, *,
               global_batch: int | None = None, seq_len: int | None = None, num_microbatches: int = 1,
               checkpoint: bool = False, precision: str | None = None, offload: bool = True,
               measure: bool = False, measure_steps: int = 3, progress: Any = None) -> list[ZeroStudyRow]:
    """The ZeRO-stage study of ``models`` (built-in names, ``package.module:function`` specs, the
    :data:`STUDY_FAMILIES` shorthands, or profiles) on ``cluster`` (a spec or its file), data-parallel
    over every device; ``global_batch`` defaults to 8 samples per device.

    ``measure=True`` runs each row on ``cluster.world_size`` CPU gloo processes for ``measure_steps``
    steps (the cluster must be CPU devices, or ``simulated``; small models only) and fills the
    ``measured_*`` fields from the last step."""
    from whalepy.tools.model_arg import load_model
    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile
    from whalepy.ir.rules import choose_lowering_kind
    from whalepy.planner.runtime_costs import LOSS_REPORT_BYTES, dp_step_payload_bytes

    if isinstance(cluster, str):
        cluster = ClusterSpec.load(cluster)
    names = _expand(models)
    W = cluster.world_size
    global_batch = global_batch or 8 * W
    if measure:
        from whalepy.tools.study_measure import check_measurable

        check_measurable(cluster, names)
    say = progress or (lambda _m: None)
    group = cluster.comm_group(list(range(W)))
    rows: list[ZeroStudyRow] = []
    for spec in names:
        if isinstance(spec, ModelProfile):
            prof, name = spec, spec.model_name
        else:
            say(f"profiling {spec}")
            loaded = load_model(spec, batch=1, seq_len=seq_len)
            prof = loaded if isinstance(loaded, ModelProfile) else _profile(loaded)
            name = spec
        P = sum(b.num_params for b in prof.blocks)
        model_rows = []
        for zero, off in zero_study_cases(cluster, offload=offload):
            cfg = ParallelConfig(dp=W, zero_stage=zero, offload=off, num_microbatches=num_microbatches,
                                 checkpoint=checkpoint)
            est = estimate_from_profile(prof, cluster, cfg, global_batch=global_batch, precision=precision)
            st, cost = est.stages[0], est.plan.stages[0].cost
            kind = choose_lowering_kind(zero, W, tp=1, pp=1, offload=off is not None)
            payload = dp_step_payload_bytes(kind, zero3=zero == 3, num_params=P,
                                            num_microbatches=num_microbatches, precision=est.plan.precision.value)
            payload[Collective.ALL_REDUCE] = payload.get(Collective.ALL_REDUCE, 0.0) + LOSS_REPORT_BYTES
            links = [estimate_collective_link_bytes(c, n, group) for c, n in payload.items()]
            model_rows.append(ZeroStudyRow(
                model=name, num_params=P, zero_stage=zero, offload=off, lowering=str(kind.value), dp=W,
                global_batch=global_batch, model_state_bytes=float(cost.model_state_bytes),
                host_state_bytes=float(cost.host_state_bytes), activation_bytes=st.memory.activations,
                buffer_bytes=st.memory.buffers, peak_bytes=st.memory_bytes, capacity_bytes=st.capacity_bytes,
                fits=est.feasible, reason=est.reason,
                payload_bytes={c.value: n for c, n in payload.items()},
                intra_node_bytes=sum(i for i, _ in links), inter_node_bytes=sum(o for _, o in links),
                step_time_s=est.step_time_s, samples_per_s=est.samples_per_s,
                tflops_per_gpu=est.plan.cost.model_tflops_per_gpu))
        if measure:
            from whalepy.tools.study_measure import measure_rows

            say(f"training {name} on {W} gloo processes, {len(model_rows)} configurations")
            model_rows = measure_rows(spec, prof, cluster, model_rows, seq_len=seq_len, steps=measure_steps,
                                      precision=precision, num_microbatches=num_microbatches,
                                      checkpoint=checkpoint)
        rows += model_rows
    return rows


def _expand(models: Sequence[str | ModelProfile] | str | ModelProfile) -> list[str | ModelProfile]:
    if isinstance(models, (str, ModelProfile)):
        models = [models]
    out: list[str | ModelProfile] = []
    for m in models:
        if isinstance(m, str):
            out += [*STUDY_FAMILIES.get(m.strip().lower(), (m,))]
        else:
            out.append(m)
    if not out:
        raise WhalepyError("no model to study: give a model name or --sizes (e.g. --sizes mt5)")
    return out


def _profile(loaded: tuple[Any, Any]) -> ModelProfile:
    from whalepy.frontend.profile import profile

    model, inputs = loaded
    return profile(model, inputs)
