"""Count the bytes a rank's collectives carry, at the process group.

Every collective of a ``torch.distributed`` process group, whoever issues it (FSDP2's all-gathers and
reduce-scatters, DDP's C++ reducer, ``ZeroRedundancyOptimizer``'s broadcasts, functional collectives),
reaches the ProcessGroup through a ``c10d`` operator of the dispatcher (``c10d::allreduce_``,
``c10d::_allgather_base_``, ...), or, for functional collectives (DTensor's redistributions under
tensor parallelism), through a ``_c10d_functional`` operator (``all_reduce``,
``all_gather_into_tensor``, ...; on a fake process group or under a ``FakeTensorMode`` these never
reach a ProcessGroup). :class:`CollectiveCounter` is a ``TorchDispatchMode`` that sees both kinds of
operators and adds up their payload in the size convention of
:mod:`whalepy.cost_models.communication`: all-reduce and broadcast the tensor, all-gather the gathered
output, reduce-scatter the whole input, all-to-all one rank's send buffer, send / recv the message.

The mode is thread-local: it sees what runs on the thread that entered it. On CPU (gloo) the autograd
engine runs backward hooks (DDP's bucket all-reduces, FSDP2's reduce-scatters) on the calling
thread, so a training step under the mode is counted whole; on CUDA backward runs on the device's
autograd thread and would be missed, which is why ``whalepy study zero --measure`` runs on CPU.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from whalepy.cost_models.communication import Collective

__all__ = ["CollectiveCounter"]


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


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: ...`` then ``c.bytes[Collective.ALL_GATHER]`` and ``c.calls``.

    A ``c10d`` operator this table does not know raises :class:`NotImplementedError` (a silent zero
    would under-count)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[Collective] = Counter()
        self.calls: Counter[Collective] = Counter()

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "c10d":
            name = func._opname
            if name in _C10D:
                kind, index = _C10D[name]
                self.bytes[kind] += _nbytes(args[index])
                self.calls[kind] += 1
            elif name not in _NO_PAYLOAD:
                raise NotImplementedError(f"CollectiveCounter does not know the c10d operator {name!r}")
        elif func.namespace == "_c10d_functional":
            name = func._opname
            if name in _FUNCTIONAL:
                kind, index, size = _FUNCTIONAL[name]
                self.bytes[kind] += _nbytes(args[index]) * (int(args[size]) if size is not None else 1)
                self.calls[kind] += 1
            elif name not in _FUNCTIONAL_NO_PAYLOAD:
                raise NotImplementedError(f"CollectiveCounter does not know the functional collective {name!r}")
        return func(*args, **(kwargs or {}))
