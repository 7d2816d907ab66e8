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

from torch.utils._python_dispatch import TorchDispatchMode

from whalepy.cost_models.communication import Collective
from whalepy.runtime.collective_ops import collective_payload

__all__ = ["CollectiveCounter"]


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
        got = collective_payload(func, args)
        if got is not None:
            self.bytes[got[0]] += got[1]
            self.calls[got[0]] += 1
        return func(*args, **(kwargs or {}))
