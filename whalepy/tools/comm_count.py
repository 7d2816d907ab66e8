"""Count the bytes a rank's collectives carry, at the process group.

Every collective of a ``torch.distributed`` process group, whoever issues it (FSDP2's all-gathers and
reduce-scatters, DDP's C++ reducer, ``ZeroRedundancyOptimizer``'s broadcasts, functional collectives),
reaches the ProcessGroup through a ``c10d`` operator of the dispatcher (``c10d::allreduce_``,
``c10d::_allgather_base_``, ...). :class:`CollectiveCounter` is a ``TorchDispatchMode`` that sees those
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
        return func(*args, **(kwargs or {}))
