"""Workarounds for older torch releases, each applied only where the release needs it.

``allow_split_factor_strided_shards``: whalepy shards a fused projection's weight (HF GPT-2's
``c_attn``, ``[q | k | v]`` along one dim) with ``_StridedShard(dim, split_factor=3)`` so each TP rank
holds ``[q_r | k_r | v_r]``. From torch 2.11 on, DTensor plans any redistribution involving a
``_StridedShard`` with its graph-based planner, which reads a ``_StridedShard`` as FSDP2's encoding
of a shard order. A split-factor ``_StridedShard`` is no such encoding, and torch 2.11 then raises
``ValueError: use_strided_shard_as_shard_order is True, but placements: (_StridedShard(dim=1,
sf=3),) is unable to be interpreted into a corresponding shard_order`` on every ``full_tensor()``
or full state dict of such a parameter. torch 2.13 catches that case
(``_StridedShardNotDecodableError``) and falls back to the greedy per-mesh-dim plan, whose
``_StridedShard`` steps reassemble the pieces correctly. This backports that fallback; on a torch
that has the error class it does nothing.

``fsdp_param_groups``: the parameter groups of one ``fully_shard`` unit. torch 2.13 keeps a list
(``FSDPState._fsdp_param_groups``, with ``_fsdp_param_group`` a property that warns when there are
several); torch 2.11 has the one attribute ``_fsdp_param_group`` (``None`` for a unit without
parameters of its own).

``match_pipeline_mode``: a pipeline stage's activation receive buffers need ``requires_grad`` for a
training step (the previous stage gets its input gradients through them) and not for ``eval``. torch
2.11 sets it once, when the schedule's first call builds them, so a schedule whose first call is
``eval`` never sends gradients back afterwards and the first stage waits for them forever (seen:
``ParallelModel.evaluate`` before the first ``train_step`` on 2 gloo ranks hung). torch 2.13 rebuilds
the buffers when the mode changes (``_PipelineSchedule._initialize_pp_stages``); on a torch without it,
this sets the existing buffers' flag for the coming call.

``pipeline_step_options``: ``schedule.step(..., return_outputs=False)`` (torch 2.8 and later) keeps no
micro-batch's output for a merged return value; without it the last stage holds every micro-batch's
output (the logits) until the step ends. On a torch without the keyword, nothing.
"""

from __future__ import annotations

import inspect
from typing import Any

_NOT_DECODABLE = "is unable to be interpreted into a corresponding shard_order"


def allow_split_factor_strided_shards() -> None:
    """Make DTensor redistribute split-factor ``_StridedShard`` tensors on torch releases that cannot
    (idempotent)."""
    from torch.distributed.tensor import _dtensor_spec, _redistribute

    if hasattr(_dtensor_spec, "_StridedShardNotDecodableError"):
        return  # torch >= 2.13 falls back to the greedy plan itself
    original = _redistribute._gen_transform_infos_non_cached
    if getattr(original, "whalepy_fallback", False):
        return

    def gen_transform_infos(src_spec: Any, dst_spec: Any, use_graph_based_transform: bool | None = None) -> Any:
        try:
            return original(src_spec, dst_spec, use_graph_based_transform)
        except ValueError as e:
            if _NOT_DECODABLE not in str(e):
                raise
            planner = _redistribute.get_redistribute_planner(src_spec.device_mesh, src_spec.tensor_meta)
            return planner.generate_greedy_transform_infos(src_spec, dst_spec)

    gen_transform_infos.whalepy_fallback = True  # type: ignore[attr-defined]
    # _gen_transform_infos (cached) looks this name up in the module at each call
    _redistribute._gen_transform_infos_non_cached = gen_transform_infos


def fsdp_param_groups(module: Any) -> list[Any]:
    """The ``FSDPParamGroup``\\ s of the ``fully_shard`` unit ``module`` on any supported torch (module
    docstring): a list, empty when the unit holds no parameters of its own."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group  # torch < 2.13
    return [] if group is None else [group]


def match_pipeline_mode(schedule: Any, train: bool) -> None:
    """Give ``schedule``'s built receive buffers the ``requires_grad`` of the coming call (module
    docstring); nothing on a torch that rebuilds them itself, or before the first call builds them."""
    from torch.distributed.pipelining import schedules

    if hasattr(schedules._PipelineSchedule, "_initialize_pp_stages"):
        return  # torch >= 2.13
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        for infos in stage.args_recv_info.values():
            for info in infos:
                buffer = getattr(info, "buffer", None)  # the first stage's placeholders have none
                if buffer is not None and buffer.requires_grad != train:
                    buffer.requires_grad_(train)


def pipeline_step_options(schedule: Any, train: bool) -> dict[str, Any]:
    """Keywords for ``schedule.step`` that keep no output the caller does not use (module docstring)."""
    if not train:
        return {}
    try:
        takes = "return_outputs" in inspect.signature(schedule.step).parameters
    except (TypeError, ValueError):
        takes = False
    return {"return_outputs": False} if takes else {}
