"""Block-level costs of one planning run (split from :mod:`whalepy.planner.costing`, which re-exports
these names): :class:`CostContext` caches each block's forward, backward and TP communication time per
device, TP degree and micro-batch, and the data-parallel collectives of a stage's blocks; the helpers
say how TP splits a block's parameters and activations, and which link a stage's sends and a shared
NIC's collectives cross."""

from __future__ import annotations

import dataclasses
import functools

from whalepy.ir.rules import tp_splits
from whalepy.cost_models.communication import Collective, CommGroup, Link, estimate_collective_time
from whalepy.cost_models.compute import estimate_block_time, estimate_kernels_time, loss_time, precision_bytes
from whalepy.cost_models.device_profiles import resolve_compute_profile
from whalepy.cost_models.memory import ModelStateBytes, estimate_model_state_bytes
from whalepy.ir.plan import TPStyle
from whalepy.ir.types import OptimizerImpl, dtype_bytes
from whalepy.planner import runtime_costs
from whalepy.planner.runtime_costs import DPComm, MemoryMargin, boundary_bytes, build_dp_block_comm, tp_backward_bytes
from whalepy.planner.space import Candidate, GroupView, Hardware, Segment, StateOption
from whalepy.ir.profile import BlockKind, BlockProfile, ModelProfile


def _shared_nic(group: CommGroup, sharers: int) -> CommGroup:
    if sharers <= 1 or group.num_nodes <= 1:
        return group
    return dataclasses.replace(group, inter=group.inter.shared(sharers))


def _pair_link(group: CommGroup) -> Link:
    return group.inter if group.num_nodes > 1 else group.intra


TP_REPLICATED_ACTIVATION_FRACTION = 10 / 34
"""Share of a transformer layer's saved activations that tensor parallelism does not split unless
sequence parallelism is on: Korthikanti et al. 2022 count ``34 sbh`` bytes per layer besides the
attention scores, of which ``10 sbh`` (the two layer-norm inputs, the dropout masks and inputs of the
residual branches) stay whole on every TP rank, giving ``sbh(10 + 24/t + 5as/(ht))``; with sequence
parallelism they are split too, ``sbh/t (34 + 5as/h)``. The profile measures a layer's total; this
fraction applies Korthikanti's split to it."""


LOSS_LOGPROB_BYTES = 4
"""Bytes per output element cross-entropy keeps for backward: its log-softmax, in fp32 (autocast runs
``cross_entropy`` / ``log_softmax`` in fp32). The profile captures the model, not the user's loss, so
the last stage is charged ``LOSS_BACKWARD_FP32_TENSORS`` of these (:func:`loss_peak_bytes`)."""

LOSS_BACKWARD_FP32_TENSORS = 3
"""fp32 tensors of the logits' size alive at once in the loss's backward, the step's activation peak
(every block's activations are still held): the saved log-probabilities, the zero-filled gradient
``nll_loss_backward`` scatters into, and the input gradient ``log_softmax_backward_data`` writes
(PyTorch's ``aten/src/ATen/native/LossNLL.cpp``, ``SoftMax.cpp``)."""


def loss_peak_bytes(output_bytes: float, elem_bytes: float, *, output_held: bool) -> float:
    """Bytes the loss adds to the last stage's activation peak, for a model output (the logits) of
    ``output_bytes`` in elements of ``elem_bytes``: ``LOSS_BACKWARD_FP32_TENSORS`` fp32 tensors of its
    size, in the loss's backward (the peak of the two single-GPU H200 runs, found with a byte-exact
    fake-tensor replay of their steps: docs/cost_model.md, "Validation: one H200").

    The output itself is not alive then unless something keeps it (``output_held``): nothing saves it
    for backward (the linear that makes it saves its input; ``.float()``'s backward needs no input;
    ``log_softmax`` saves its result, ``SoftMax.cpp``), and the runtime's step drops it when ``loss_fn``
    returns (``ParallelModel._accumulate``). A pipeline's last stage keeps the output of the micro-batch
    in its backward (``torch.distributed.pipelining``'s ``fwd_cache``, which the stage's backward reads),
    so it is charged there; the runtime steps the schedule with ``return_outputs=False``, so the outputs
    of the micro-batches done are not kept to the step's end (``output_chunks``; runtime/pipeline.py).
    The forward's end (the output, its fp32 copy and the log-probabilities: 10 bytes per element at 16
    bits, 8 at fp32) is below the backward's 12."""
    fp32 = LOSS_BACKWARD_FP32_TENSORS * output_bytes / elem_bytes * LOSS_LOGPROB_BYTES
    return fp32 + (output_bytes if output_held else 0.0)


def loss_kept_bytes(output_bytes: float, elem_bytes: float) -> float:
    """Bytes a micro-batch whose loss is computed but whose backward has not started keeps on a
    pipeline's last stage: its output (``fwd_cache``) and the loss's fp32 log-probabilities (saved by
    ``log_softmax``). GPipe's last stage holds them for every micro-batch in flight but the one in its
    loss's backward (:func:`loss_peak_bytes`): traced on 2 gloo ranks (tests/test_fsdp_memory.py), the
    last stage's peak, the first loss backward, held the other micro-batch's two logit-sized tensors."""
    return output_bytes + output_bytes / elem_bytes * LOSS_LOGPROB_BYTES


def has_sequence_rules(profile: ModelProfile) -> bool:
    return any(r.style is TPStyle.SEQUENCE for b in profile.blocks for r in b.tp_rules)


def tp_activation_fraction(block: BlockProfile, tp: int, sequence_parallel: bool) -> float:
    """Fraction of ``block``'s saved activations held per rank of a TP group of ``tp``."""
    if not tp_splits(block, tp) or tp == 1:
        return 1.0
    if block.kind is BlockKind.LAYER and not sequence_parallel:
        f = TP_REPLICATED_ACTIVATION_FRACTION
        return f + (1 - f) / tp
    return 1 / tp


class CostContext:
    """Caches block-level costs shared across candidates of one planning run."""

    def __init__(self, profile: ModelProfile, hw: Hardware, *, precision: str = "bf16",
                 sequence_parallel: bool | None = None, clip_gradients: bool = False,
                 optimizer_impl: OptimizerImpl | str = OptimizerImpl.AS_GIVEN, compile: bool = False,
                 memory_margin: MemoryMargin | None = None) -> None:
        self.profile = profile
        self.hw = hw
        self.precision = precision
        self.memory_margin = memory_margin
        """Device memory left unplanned (``PlannerOptions.memory_margin``; None: none)."""
        self.clip_gradients = clip_gradients
        """The run clips gradients (``PlannerOptions.clip_gradients``): ZeRO-Offload steps after backward."""
        self.optimizer_impl = OptimizerImpl(optimizer_impl)
        """The optimizer implementation the runtime lowers (``Plan.optimizer_impl``), charged by
        ``_offload_costs.device_optimizer_implementation``."""
        self.compile = compile
        """The blocks run compiled (``Plan.compile``): measured block times are the compiled ones where
        ``measure(compile=True)`` timed them (``MeasuredCosts.compiled``); modelled times stay the eager
        model's (no compiled-kernel rate is derived: docs/runtime.md)."""
        # Sequence parallelism is on when the profile carries SEQUENCE rules (the runtime lowers them).
        self.sequence_parallel = (has_sequence_rules(profile) if sequence_parallel is None
                                  else sequence_parallel)
        # Profiles measure bytes in the model's own dtype (often fp32 when built for planning); training
        # keeps activations, communicated tensors and weight reads in the training precision.
        self.byte_scale = precision_bytes(precision) / dtype_bytes(profile.dtype)
        self.block_time = functools.lru_cache(maxsize=None)(self._block_time)
        self.autocast_extra = functools.lru_cache(maxsize=None)(self._autocast_extra)
        self.collective = functools.lru_cache(maxsize=None)(self._collective)
        # per-segment costs repeat across the stages and candidates of a run: computed once each, keyed
        # by the segments' identity (hashing them would hash every block profile); _kept keeps them alive
        self._kept: dict[int, tuple[Segment, ...]] = {}
        self._cache: dict[tuple, object] = {}  # type: ignore[type-arg]
        self.boundary_bytes = boundary_bytes([b.output_bytes for b in profile.blocks], profile.dtype, precision)
        self.measured = _measured_by_device(profile, hw)
        """Device type -> the measured block costs the planner prefers (``whalepy.ir.measured``)."""
        self.signatures: tuple[str, ...] = ()
        if self.measured:
            from whalepy.ir.measured import block_signature

            self.signatures = tuple(block_signature(profile, b) for b in profile.blocks)

    def _collective(self, kind: Collective, nbytes: float, group: CommGroup) -> float:
        return estimate_collective_time(kind, nbytes, group)

    def _cached(self, name: str, segments: tuple[Segment, ...], args: tuple, fn):  # type: ignore[no-untyped-def, type-arg]
        key = (name, id(segments), *args)
        if key not in self._cache:
            self._kept[id(segments)] = segments
            self._cache[key] = fn()
        return self._cache[key]

    def dp_block_comm(self, segments: tuple[Segment, ...], seg_params: tuple[float, ...],
                      group: CommGroup | None) -> DPComm:
        """:func:`build_dp_block_comm` of a stage's data-parallel group (cached)."""
        units = tuple(self.fsdp_units(seg.block.index) for seg in segments)
        return self._cached("dp", segments, (seg_params, group), lambda: build_dp_block_comm(
            self.collective, segments, list(seg_params), group, self.precision,
            units if any(u != 1 for u in units) else None))

    def fsdp_units(self, block_index: int) -> int:
        """FSDP2 units the runtime lowers the block as, counted by measured planning on any device type
        (the lowering does not depend on it), else 1."""
        if not self.measured:
            return 1
        sig = self.signatures[block_index]
        for m in self.measured.values():
            if sig in m.fsdp_units:
                return max(int(m.fsdp_units[sig]), 1)
        return 1

    def segment_costs(self, segments: tuple[Segment, ...], device_name: str, tp: int, micro_batch: float,
                      tp_group: CommGroup | None) -> tuple[tuple[float, ...], ...]:
        """Cached :meth:`_segment_costs`."""
        return self._cached("seg", segments, (device_name, tp, micro_batch, tp_group),
                            lambda: self._segment_costs(segments, device_name, tp, micro_batch, tp_group))

    def _segment_costs(self, segments: tuple[Segment, ...], device_name: str, tp: int, micro_batch: float,
                       tp_group: CommGroup | None) -> tuple[tuple[float, ...], ...]:
        """Per segment, one block's ``(time, recompute, forward, backward, TP communication, saved
        bytes, input bytes)`` for one micro-batch on one device of a TP group (``tp_group``: its ranks'
        communicator, None without TP): the forward runs the block's TP all-reduce (and an LM head's
        all-gather), the backward its own all-reduce (``tp_backward_bytes``: the column-parallel
        modules' input gradients)."""
        ratio = micro_batch / self.profile.batch_size
        rows = []
        for seg in segments:
            b = seg.block
            fwd, bwd = self.block_time(b.index, device_name, tp, micro_batch)
            ar_f = ar_b = 0.0  # forward and backward TP collectives (runtime_costs.tp_step_payload_bytes)
            if tp_group is not None and tp_splits(b, tp):
                counted = self.measured_tp_collectives(b.index, device_name, tp)
                scale = ratio * self.byte_scale
                if counted is not None:  # the calls the runtime issues, counted when measured as lowered
                    ar_f, ar_b = (self._counted_collectives(counted.get(ph, {}), micro_batch, tp_group)
                                  for ph in ("f", "b"))
                else:  # the pattern pass's bytes: row-parallel outputs and a head's logits forward,
                    # column-parallel input gradients backward
                    if b.tp_comm_bytes:
                        ar_f = self.collective(Collective.ALL_REDUCE, b.tp_comm_bytes * scale, tp_group)
                    if b.tp_gather_bytes:
                        ar_f += self.collective(Collective.ALL_GATHER, b.tp_gather_bytes * scale, tp_group)
                    if tp_backward_bytes(b):
                        ar_b = self.collective(Collective.ALL_REDUCE, tp_backward_bytes(b) * scale, tp_group)
            rows.append((fwd + bwd + ar_f + ar_b, (fwd + ar_f) * self.recompute_ratio(device_name, micro_batch),
                         fwd, bwd + ar_b, ar_f + ar_b,
                         b.activation_bytes * ratio * self.byte_scale
                         * tp_activation_fraction(b, tp, self.sequence_parallel),
                         b.input_bytes * ratio * self.byte_scale))
        return tuple(zip(*rows)) if rows else ((),) * 7

    def _block_time(self, block_index: int, device_name: str, tp: int, micro_batch: float
                    ) -> tuple[float, float]:
        """Forward and backward seconds of one block for one micro-batch on one device of a TP group:
        the shape-dependent model of :func:`estimate_kernels_time` over the block's recorded GEMMs,
        attention and memory-bound bytes, with the device's profile (calibrated, shipped or datasheet
        transfer); blocks without recorded kernels use the aggregate roofline."""
        b = self.profile.blocks[block_index]
        div = tp if tp_splits(b, tp) else 1
        measured = self.measured_block_time(block_index, device_name, div, micro_batch)
        if measured is not None:
            return measured
        device = next(g.device for g in self.hw.groups if g.device.name == device_name)
        ratio = micro_batch / self.profile.batch_size
        if b.kernels is not None:
            fwd, bwd = estimate_kernels_time(b.kernels, device=device, precision=self.precision, batch_ratio=ratio,
                                             tp=div, byte_scale=self.byte_scale, compiled=bool(self.compile))
            lf, lb = self.loss_time(block_index, device_name, micro_batch)
            return fwd + lf, bwd + lb
        act_bytes = max(0.0, b.bytes_moved - b.param_bytes) * ratio
        t = estimate_block_time(forward_flops=b.fwd_flops * ratio / div,
                                forward_bytes=(b.param_bytes + act_bytes) * self.byte_scale / div, device=device,
                                backward_flops=b.bwd_flops * ratio / div, precision=self.precision)
        return t.forward_s, t.backward_s

    def measured_block_time(self, block_index: int, device_name: str, tp: int, micro_batch: float
                            ) -> tuple[float, float] | None:
        """The block's measured forward and backward seconds on ``device_name`` at TP degree ``tp`` (the
        degree it runs at: 1 where TP does not apply to it), or None where it was not measured."""
        m = self.measured.get(device_name)
        if m is None:
            return None
        sig = self.signatures[block_index]
        if self.compile:  # the compiled blocks' own times where they were measured (Plan.compile)
            got = m.block_time(sig, self.precision, tp, micro_batch, compiled=True)
            if got is not None:
                return got
        return m.block_time(sig, self.precision, tp, micro_batch)

    def measured_tp_collectives(self, block_index: int, device_name: str, tp: int
                                ) -> dict[str, dict[str, tuple[float, float]]] | None:
        """``phase -> kind -> (calls, bytes per sample)`` of the block's TP collectives at degree ``tp`` as
        counted when it was measured as lowered (``MeasuredCosts.tp_collectives``), or None."""
        m = self.measured.get(device_name)
        if m is None:
            return None
        return m.tp_collectives.get(self.signatures[block_index], {}).get(tp)

    def _counted_collectives(self, kinds: dict[str, tuple[float, float]], micro_batch: float,
                             group: CommGroup) -> float:
        """Seconds of ``calls`` collectives per kind, each carrying an equal share of the counted bytes
        (measured in the plan's precision) at ``micro_batch`` samples."""
        total = 0.0
        for kind, (calls, per_sample) in kinds.items():
            if calls > 0:
                n = int(round(calls))
                total += n * self.collective(Collective(kind), per_sample * micro_batch / n, group)
        return total

    def recompute_ratio(self, device_name: str, micro_batch: float) -> float:
        """Seconds a checkpointed block's recompute takes per second of its forward on ``device_name``:
        measured (``MeasuredCosts.recompute_ratio``, the whole model checkpointed against the plain step),
        else 1.0 (its forward again)."""
        m = self.measured.get(device_name)
        got = m.recompute_ratio_at(self.precision, micro_batch) if m is not None else None
        return 1.0 if got is None else got

    def wrapper_overhead(self, block_index: int, device_name: str, wrapper: str, micro_batch: float,
                         tp: int = 1) -> float:
        """Seconds per micro-batch (forward plus backward) the runtime's data-parallel ``wrapper``
        (``"fsdp"`` / ``"fsdp_reshard"``) adds to the block on ``device_name`` as measured on a fake
        process group (``MeasuredCosts.wrapper_overhead``); where that was not measured, on a GPU
        :data:`~whalepy.planner.runtime_costs.FSDP2_UNIT_HOST_S` per FSDP2 unit of the block (its hooks'
        host work, measured on an H200) while the block's modelled forward + backward at TP degree ``tp``
        is within :data:`~whalepy.planner.runtime_costs.FSDP2_HOST_MEASURED_MAX_S`, on a CPU device type
        0 (its ranks are measured in the tests and benchmarks that plan them)."""
        m = self.measured.get(device_name)
        got = None
        if m is not None:
            sig = self.signatures[block_index]
            got = m.wrapper_overhead(sig, self.precision, wrapper, micro_batch, compiled=True) if self.compile else None
            if got is None:
                got = m.wrapper_overhead(sig, self.precision, wrapper, micro_batch)
        if got:
            return sum(got)
        device = next(g.device for g in self.hw.groups if g.device.name == device_name)
        if getattr(device, "vendor", None) == "cpu":
            return 0.0
        div = tp if tp_splits(self.profile.blocks[block_index], tp) else 1
        if sum(self.block_time(block_index, device_name, div, micro_batch)) > runtime_costs.FSDP2_HOST_MEASURED_MAX_S:
            return 0.0  # beyond the measured blocks: the host runs ahead of a long block (runtime_costs)
        return runtime_costs.FSDP2_UNIT_HOST_S * self.fsdp_units(block_index)

    def update_overhead(self, block_index: int, device_name: str, *, fsdp: bool, tp: int) -> float:
        """Seconds per step the optimizer spends on the block's parameters as DTensor shards beyond the
        plain step's share (FSDP2 shards and / or tensor-parallel shards of degree ``tp``), as measured
        (``MeasuredCosts.update_overhead``; the larger where both apply); 0 where not measured."""
        m = self.measured.get(device_name)
        if m is None:
            return 0.0
        sig = self.signatures[block_index]
        keys = [k for k in m.wrapped_updates.get(sig, {}) if (fsdp and k.startswith("fsdp/"))]
        if tp > 1 and tp_splits(self.profile.blocks[block_index], tp):
            keys.append(f"tp/{tp}")
        return max((m.update_overhead(sig, k) or 0.0 for k in keys), default=0.0)

    def block_cost_source(self, block_index: int, device_name: str, tp: int) -> str:
        """``"measured"`` or ``"modelled"``: where :meth:`block_time` takes this block's time from."""
        div = tp if tp_splits(self.profile.blocks[block_index], tp) else 1
        return "measured" if self.measured_block_time(block_index, device_name, div, 1.0) is not None else "modelled"

    def compiled_time_measured(self, block_index: int, device_name: str, tp: int) -> bool:
        """Whether the block's compiled forward / backward was measured (``MeasuredCosts.compiled``) at
        the degree it runs at."""
        m = self.measured.get(device_name)
        if m is None:
            return False
        div = tp if tp_splits(self.profile.blocks[block_index], tp) else 1
        return m.block_time(self.signatures[block_index], self.precision, div, 1.0, compiled=True) is not None

    def optimizer_s_per_param(self, device_name: str) -> float | None:
        """Measured optimizer-step seconds per parameter on ``device_name`` over this model's blocks (the
        implementation measured, :attr:`MeasuredCosts.optimizer`), or None: the model charges it."""
        m = self.measured.get(device_name)
        if m is None:
            return None
        return m.optimizer_s_per_param((self.signatures[b.index], b.num_params) for b in self.profile.blocks)

    def cost_source_notes(self, plan) -> list[str]:  # type: ignore[no-untyped-def]
        """One line per stage of ``plan`` saying which of its costs were measured on its device types and
        which modelled; empty when nothing was measured, one line when the profile was measured on a
        device type the cluster does not have (its measurements unused)."""
        lines = []
        own = self.profile.measured
        if own is not None and own.device_type not in {g.device.name for g in self.hw.groups}:
            types = ", ".join(dict.fromkeys(g.device.name for g in self.hw.groups))
            lines.append(f"the profile's measurements are of {own.device_type}, a device type this cluster does "
                         f"not have ({types}): none of them used (measure on the cluster's device: "
                         "whalepy.profile(..., measure=True, device=...) on one of its machines)")
        if not self.measured:
            return lines
        index = {b.name: b.index for b in self.profile.blocks}
        for st in plan.stages:
            parts = []
            for dev in dict.fromkeys(st.device_types):
                blocks = [index[n] for n in st.block_names]
                k = sum(self.block_cost_source(i, dev, st.tp_degree) == "measured" for i in blocks)
                opt = "measured" if self.optimizer_s_per_param(dev) is not None else "modelled"
                parts.append(f"on {dev}: block forward/backward/recompute measured for {k} of {len(blocks)} blocks"
                             f"{'' if k == len(blocks) else ' (the rest modelled)'}, optimizer step {opt}")
                if self.compile and k:  # the plan compiles: were the compiled blocks themselves timed?
                    c = sum(self.compiled_time_measured(i, dev, st.tp_degree) for i in blocks)
                    if c < k:
                        parts[-1] += (f"; compiled blocks timed for {c} of {k}, the rest from their eager times "
                                      "(the compiled step runs faster than that part of the prediction)")
            lines.append(f"stage {st.index} costs: {'; '.join(parts)}; communication (alpha-beta over the cluster "
                         "spec's links), pipeline bubble and model-state memory modelled")
        return lines

    def model_time_per_sample(self, device: GroupView) -> float:
        """Forward + backward seconds of one sample through the whole model on one device."""
        return sum(sum(self.block_time(i, device.device.name, 1, 1.0)) for i in range(len(self.profile.blocks)))

    def loss_time(self, block_index: int, device_name: str, micro_batch: float) -> tuple[float, float]:
        """The loss's forward and backward seconds, charged to the last block (cross-entropy over its
        output, :func:`~whalepy.cost_models.compute.loss_time`, as ``LOSS_LOGPROB_BYTES`` assumes)."""
        if block_index != len(self.profile.blocks) - 1:
            return 0.0, 0.0
        b = self.profile.blocks[block_index]
        device = next(g.device for g in self.hw.groups if g.device.name == device_name)
        elem = dtype_bytes(self.profile.dtype)
        logits = b.output_bytes / elem * micro_batch / self.profile.batch_size
        return loss_time(logits, logits_bytes=precision_bytes(self.precision), profile=resolve_compute_profile(device))

    def _autocast_extra(self, block_index: int, device_name: str, tp: int, micro_batch: float) -> float:
        """Seconds one block's forward + backward takes beyond :meth:`block_time` when it runs under
        ``torch.autocast`` over fp32 parameters (fp32 tensors where autocast keeps them, its casts), for
        the options the runtime lowers that way (``_runtime_costs.uses_autocast``); 0 in fp32."""
        b = self.profile.blocks[block_index]
        if self.precision == "fp32" or b.kernels is None or b.kernels.amp is None:
            return 0.0
        div = tp if tp_splits(b, tp) else 1
        if self.measured_block_time(block_index, device_name, div, micro_batch) is not None:
            return 0.0  # a measured time already holds what the runtime ran, autocast's casts included
        device = next(g.device for g in self.hw.groups if g.device.name == device_name)
        kw = dict(device=device, precision=self.precision, batch_ratio=micro_batch / self.profile.batch_size,
                  tp=div, byte_scale=self.byte_scale, compiled=self.compile)
        plain = sum(estimate_kernels_time(b.kernels, **kw))  # type: ignore[arg-type]
        return max(0.0, sum(estimate_kernels_time(b.kernels, autocast=True, **kw)) - plain)  # type: ignore[arg-type]

    def _saved_fit(self, block_index: int) -> tuple[float, float] | None:
        """``MeasuredCosts.saved_fit`` of the block from the profile's own measurement (whose per-sample
        part ``apply_measured_activations`` put in the block's ``activation_bytes``) in this plan's
        precision: the compiled blocks' where the plan compiles and they were measured; None if not."""
        own = self.profile.measured
        if own is None or self.precision == "fp32":
            return None
        key = ("saved_fit", block_index)
        if key not in self._cache:
            from whalepy.ir.measured import block_signature

            sig = block_signature(self.profile, self.profile.blocks[block_index])
            self._cache[key] = ((own.saved_fit(sig, self.precision, compiled=True) if self.compile else None)
                                or own.saved_fit(sig, self.precision))
        return self._cache[key]  # type: ignore[return-value]

    def autocast_copy_bytes(self, device_name: str) -> float:
        """Bytes per parameter autocast's 16-bit weight copies take while a micro-batch's activations are
        held (DDP and one device, ``runtime_costs.uses_autocast``): ``AUTOCAST_WEIGHT_COPY_BYTES``, or on
        the device type the profile was measured on, with every block's saved bytes measured at two
        micro-batch sizes or more, what the blocks save whatever the micro-batch size
        (``MeasuredCosts.saved_fit``), over their parameters. Compiled blocks may keep fewer (the
        partitioner recomputes a cast in backward rather than save it) or more."""
        from whalepy.cost_models.memory import AUTOCAST_WEIGHT_COPY_BYTES

        own = self.profile.measured
        if own is None or own.device_type != device_name:
            return float(AUTOCAST_WEIGHT_COPY_BYTES)
        key = ("autocast_copy", device_name)
        if key not in self._cache:
            from whalepy.ir.measured import block_signature

            fixed = params = 0.0
            for i, b in enumerate(self.profile.blocks):
                sig = block_signature(self.profile, b)
                compiled = self.compile and own.saved_fit(sig, self.precision, compiled=True) is not None
                sizes = {mb for p, c, mb in own.saved.get(sig, {}) if p == self.precision and c == compiled}
                fit = self._saved_fit(i)
                if fit is None or len(sizes) < 2:  # one size: the copies stay in the bytes per sample
                    params = 0.0
                    break
                fixed, params = fixed + fit[0], params + b.num_params
            self._cache[key] = fixed / params if params else float(AUTOCAST_WEIGHT_COPY_BYTES)
        return self._cache[key]  # type: ignore[return-value]

    def autocast_saved_extra(self, block_index: int, micro_batch: float) -> float:
        """Bytes one block keeps for backward under autocast beyond its 16-bit figure (fp32 tensors where
        autocast keeps them, a cast copy per 16-bit op of an fp32 input; ``whalepy.passes.autocast``);
        its 16-bit input (the fp32 residual's extra half) where the block has no such record. 0 where the
        block's saved bytes were measured under autocast (``_saved_fit``: they hold these already)."""
        if self._saved_fit(block_index) is not None:
            return 0.0
        b = self.profile.blocks[block_index]
        ratio = micro_batch / self.profile.batch_size
        if b.kernels is None or b.kernels.amp is None:
            return b.input_bytes * ratio * self.byte_scale
        return max(0.0, b.kernels.amp.amp_saved - b.activation_bytes * self.byte_scale) * ratio

def _measured_by_device(profile: ModelProfile, hw: Hardware) -> dict:  # type: ignore[type-arg]
    """Per device type of the cluster, the measured costs: the profile's own (``measure=True``, for the
    type it was measured on) over the device profile's ``measured`` section."""
    from whalepy.cost_models.device_profiles import resolve_compute_profile

    out = {}
    for g in hw.groups:
        name = g.device.name
        if name in out:
            continue
        m = resolve_compute_profile(g.device).measured
        own = profile.measured
        if own is not None and own.device_type == name:
            m = own if m is None else m.merged(own)
        if m is not None:
            out[name] = m
    return out


def stage_model_states(ctx: CostContext, cand: Candidate, option: StateOption, num_params: float, *,
                       working_param_bytes: float = 0.0, largest_block_params: float = 0.0,
                       prefetch_depth: int = 1, num_blocks: int | None = None) -> ModelStateBytes:
    """Model-state bytes per device of a stage of ``cand`` with ``num_params`` local parameters under
    ``option``, as the runtime lowers it (:func:`estimate_model_state_bytes`; the last three size the
    disk tier's staging buffers; an option beside offloaded blocks is lowered as they are)."""
    return estimate_model_state_bytes(
        num_params=num_params, zero_stage=option.zero, dp_degree=cand.dp, tp_degree=cand.tp,
        pp_degree=cand.num_stages, precision=ctx.precision, param_tier=option.param_tier,
        optimizer_tier=option.optimizer_tier, working_param_bytes=working_param_bytes,
        largest_block_params=largest_block_params, prefetch_depth=prefetch_depth, num_blocks=num_blocks,
        stage_offloads=option.beside_offload)
