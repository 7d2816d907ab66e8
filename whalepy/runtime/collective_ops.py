"""The payload of a ``torch.distributed`` collective as it reaches the dispatcher: which collective of
the cost model (:class:`whalepy.cost_models.communication.Collective`) and how many bytes, in its size
convention (all-reduce and broadcast the tensor, all-gather the gathered output, reduce-scatter the whole
input, all-to-all one rank's send buffer, send / recv the message). Used by the collective counter of
``whalepy check`` / ``study zero --measure`` (``tools.comm_count``) and by measured planning's count of
the collectives each block issues as lowered (``runtime.measure_lowered``).

``c10d`` operators are what every ProcessGroup call goes through (FSDP2, DDP, ZeroRedundancyOptimizer,
``torch.distributed`` calls); ``_c10d_functional`` operators are the functional collectives DTensor's
redistributions issue (on a fake process group or under a ``FakeTensorMode`` these never reach a
ProcessGroup)."""

from __future__ import annotations

from typing import Any

import torch

from whalepy.cost_models.communication import Collective

__all__ = ["collective_payload"]


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


# c10d operator -> (collective, index of the argument whose bytes are the payload)
_C10D: dict[str, tuple[Collective, int]] = {
    "allreduce_": (Collective.ALL_REDUCE, 0),
    "allreduce_coalesced_": (Collective.ALL_REDUCE, 0),
    "allgather_": (Collective.ALL_GATHER, 0),
    "_allgather_base_": (Collective.ALL_GATHER, 0),
    "allgather_coalesced_": (Collective.ALL_GATHER, 0),
    "allgather_into_tensor_coalesced_": (Collective.ALL_GATHER, 0),
    "reduce_scatter_": (Collective.REDUCE_SCATTER, 1),
    "_reduce_scatter_base_": (Collective.REDUCE_SCATTER, 1),
    "reduce_scatter_tensor_coalesced_": (Collective.REDUCE_SCATTER, 1),
    "broadcast_": (Collective.BROADCAST, 0),
    "alltoall_": (Collective.ALL_TO_ALL, 1),
    "alltoall_base_": (Collective.ALL_TO_ALL, 1),
    "send": (Collective.SEND_RECV, 0),
    "recv_": (Collective.SEND_RECV, 0),
}
_NO_PAYLOAD = {"barrier", "monitored_barrier_"}

# functional collectives (``torch.distributed._functional_collectives``: what DTensor's redistributions
# issue) -> (collective, index of the input, index of the group size for an all-gather's output or None)
_FUNCTIONAL: dict[str, tuple[Collective, int, int | None]] = {
    "all_reduce": (Collective.ALL_REDUCE, 0, None),
    "all_reduce_": (Collective.ALL_REDUCE, 0, None),
    "all_reduce_coalesced": (Collective.ALL_REDUCE, 0, None),
    "all_reduce_coalesced_": (Collective.ALL_REDUCE, 0, None),
    "all_gather_into_tensor": (Collective.ALL_GATHER, 0, 1),
    "all_gather_into_tensor_out": (Collective.ALL_GATHER, 0, 1),
    "all_gather_into_tensor_coalesced": (Collective.ALL_GATHER, 0, 1),
    "reduce_scatter_tensor": (Collective.REDUCE_SCATTER, 0, None),
    "reduce_scatter_tensor_coalesced": (Collective.REDUCE_SCATTER, 0, None),
    "all_to_all_single": (Collective.ALL_TO_ALL, 0, None),
    "broadcast": (Collective.BROADCAST, 0, None),
    "broadcast_": (Collective.BROADCAST, 0, None),
}
_FUNCTIONAL_NO_PAYLOAD = {"wait_tensor"}


def collective_payload(func: Any, args: tuple, *, strict: bool = True) -> tuple[Collective, int] | None:
    """``(collective, payload bytes)`` of the dispatcher operator ``func`` called with ``args``, or None
    for an operator that is not a collective (or carries no payload: barriers, waits). An unknown ``c10d``
    or functional-collective operator raises :class:`NotImplementedError` under ``strict`` (a silent
    zero would under-count), else gives None."""
    name = func._opname
    if func.namespace == "c10d":
        if name in _C10D:
            kind, index = _C10D[name]
            return kind, _nbytes(args[index])
        if name not in _NO_PAYLOAD and strict:
            raise NotImplementedError(f"the collective counter does not know the c10d operator {name!r}")
    elif func.namespace == "_c10d_functional":
        if name in _FUNCTIONAL:
            kind, index, size = _FUNCTIONAL[name]
            return kind, _nbytes(args[index]) * (int(args[size]) if size is not None else 1)
        if name not in _FUNCTIONAL_NO_PAYLOAD and strict:
            raise NotImplementedError(f"the collective counter does not know the functional collective {name!r}")
    return None
