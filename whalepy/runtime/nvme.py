"""The ``nvme`` tier for optimizer states (ZeRO-Infinity's optimizer offload to NVMe).

PyTorch has no NVMe tier, so whalepy adds one around the user's optimizer. Blocks whose
``BlockPlan.optimizer_tier`` is ``nvme`` keep the tensor states of their parameters (AdamW's
``exp_avg`` / ``exp_avg_sq``: the local shards under FSDP2, whole tensors under DDP) in files under
``nvme_dir`` between steps.

Mechanism: every such state tensor is re-homed, right after the step that created it, into a file
mapped into memory (``torch.from_file(path, shared=True)``, a ``MAP_SHARED`` mapping) and the
optimizer's state entry is replaced by a tensor over that mapping (a DTensor over it, with the same
mesh, placements, shape and stride, when the state is a DTensor). The file, not anonymous memory,
is then the home of the state: the kernel writes the dirty pages back to the file and may drop them
under memory pressure, and pages them back in on access.

* Parameters whose local tensors are on the CPU (CPU training, or FSDP2's ``CPUOffloadPolicy``):
  the optimizer updates the mapped tensors in place (AdamW's ``lerp_`` / ``mul_`` / ``addcmul_``), so
  there is no copy at all after the first step; paging is the OS's job.
* Parameters on an accelerator: an optimizer step pre-hook swaps the states in (one device tensor per
  state, copied from the mapping), the step runs on the device, and the post-hook swaps them out
  (copied back into the mapping) and frees the device copies. Between steps the device holds none of
  the NVMe blocks' optimizer states.

Why a mapping rather than ``torch.save`` / ``torch.load`` per step: the state stays an ordinary
tensor of the optimizer between steps, so ``optimizer.state_dict()``, ``get_state_dict`` and DCP
read and write it like any other (checkpoints are unchanged), and on the CPU the step itself needs
no staging buffer. ZeRO-Infinity (Rajbhandari et al., SC'21) swaps per parameter group with
prefetch overlapping the step; here a swap covers all offloaded states of the optimizer at once and
is not overlapped with compute (see docs/runtime.md, Limitations). Scalar states (AdamW's ``step``)
stay in memory. After ``optimizer.load_state_dict`` (which builds fresh tensors) call
:meth:`NvmeOptimizerStates.offload` to re-home them at once; otherwise the next step does it.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from whalepy._errors import WhalepyError

__all__ = ["NvmeOptimizerStates", "default_nvme_dir", "prepare_nvme_dir"]

_counter = itertools.count()


def default_nvme_dir(root: str | os.PathLike[str] | None, rank: int) -> Path:
    """This process's directory for one optimizer's NVMe states: ``<root>/whalepy-nvme-<pid>-rank<r>``
    (a ``-<n>`` suffix for the second and later optimizers of the process); ``root`` defaults to
    :func:`tempfile.gettempdir`."""
    base = Path(root) if root is not None else Path(tempfile.gettempdir())
    n = next(_counter)
    return base / (f"whalepy-nvme-{os.getpid()}-rank{rank}" + (f"-{n}" if n else ""))


def prepare_nvme_dir(path: Path, *, user_dir: str | os.PathLike[str] | None = None) -> Path:
    """Create ``path`` and check that files can be written there; :class:`WhalepyError` naming the
    directory otherwise. Registers its removal at interpreter exit (the files are swap space, not a
    checkpoint)."""
    shown = os.fspath(user_dir) if user_dir is not None else os.fspath(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".whalepy-probe"
        with open(probe, "wb") as f:
            f.write(b"\0" * 8)
        probe.unlink()
    except OSError as e:
        raise WhalepyError(
            f"nvme_dir {shown!r} is not writable ({e.strerror or e}); optimizer states of blocks with "
            "optimizer_tier='nvme' are kept in files there. Pass parallelize(..., nvme_dir=...) a "
            "writable directory on the node's NVMe drive") from None
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in the DTensor form of ``like`` (same spec: mesh, placements, global shape, stride).

    Built as FSDP2 builds its CPU-offloaded shards (``DTensor(local, spec)``): ``DTensor.from_local``
    would move a CPU ``local`` onto a GPU mesh's device."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    return DTensor(local, like._spec, requires_grad=False)


def _span(t: torch.Tensor) -> int:
    """Elements of storage a dense tensor of ``t``'s sizes and strides needs."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))


class NvmeOptimizerStates:
    """Keeps the tensor states of ``params`` in ``optimizer`` in memory-mapped files under
    ``directory`` between steps (see the module docstring).

    ``always_swap=True`` uses the explicit swap-in / swap-out path even for CPU parameters (the path
    accelerator parameters take; tests use it to exercise that path without a GPU)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter],
                 directory: Path, *, always_swap: bool = False) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # under ZeRO-1 the states live in the wrapped per-rank optimizer, which ZeRO's step calls
        self.optimizer = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        self.directory = Path(directory)
        self.always_swap = always_swap
        self._index: dict[int, int] = {}
        self._params: list[nn.Parameter] = []
        for p in params:
            if id(p) not in self._index:
                self._index[id(p)] = len(self._params)
                self._params.append(p)
        # (param index, state key) -> the mapped local tensor that is the state's home
        self._homes: dict[tuple[int, str], torch.Tensor] = {}
        self._pre = self.optimizer.register_step_pre_hook(lambda *_: self.swap_in())
        self._post = self.optimizer.register_step_post_hook(lambda *_: self.offload())

    # -- what is offloaded ---------------------------------------------------------------------

    def _entries(self) -> Iterable[tuple[int, nn.Parameter, dict[str, Any], str, torch.Tensor]]:
        for p in self._params:
            state = self.optimizer.state.get(p)
            if not state:
                continue
            for key, v in list(state.items()):
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    yield self._index[id(p)], p, state, key, v

    def _swaps(self, p: nn.Parameter) -> bool:
        return self.always_swap or _local(p).device.type != "cpu"

    def files(self) -> list[Path]:
        """The state files written so far."""
        return sorted(self.directory.glob("*.bin"))

    @property
    def nbytes(self) -> int:
        """Bytes of optimizer state held in files."""
        return sum(t.numel() * t.element_size() for t in self._homes.values())

    def is_mapped(self, t: torch.Tensor) -> bool:
        """Whether state tensor ``t`` is (a DTensor over) one of the file mappings."""
        loc = _local(t)
        return any(h.data_ptr() == loc.data_ptr() and h.shape == loc.shape for h in self._homes.values())

    # -- moving states -------------------------------------------------------------------------

    def _home(self, i: int, key: str, like: torch.Tensor) -> torch.Tensor:
        """The mapped tensor for state ``key`` of parameter ``i``, with ``like``'s local sizes, strides
        and dtype (a new file when there is none yet or the layout changed)."""
        old = self._homes.get((i, key))
        if (old is not None and old.shape == like.shape and old.stride() == like.stride()
                and old.dtype == like.dtype):
            return old
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
        path = self.directory / f"p{i:05d}.{name}.bin"
        span = _span(like)
        with open(path, "wb") as f:  # exact size: a shorter file would fault, a longer one misreport
            f.truncate(span * like.element_size())
        flat = torch.from_file(os.fspath(path), shared=True, size=span, dtype=like.dtype)
        home = flat.as_strided(like.shape, like.stride())
        self._homes[(i, key)] = home
        return home

    @torch.no_grad()
    def offload(self) -> None:
        """Move every offloaded state that is not in its file yet (new after a first step, swapped in
        for an accelerator step, or replaced by ``load_state_dict``) into its file, and point the
        optimizer's state entry at the mapping."""
        for i, _p, state, key, v in self._entries():
            loc = _local(v)
            home = self._homes.get((i, key))
            if home is not None and home.data_ptr() == loc.data_ptr() and home.shape == loc.shape:
                continue
            home = self._home(i, key, loc)
            home.copy_(loc)
            state[key] = _rewrap(v, home)

    @torch.no_grad()
    def swap_in(self) -> None:
        """Before a step: copy the states of accelerator parameters from their files to the device."""
        for i, p, state, key, v in self._entries():
            home = self._homes.get((i, key))
            if not self._swaps(p) or home is None or home.data_ptr() != _local(v).data_ptr():
                continue
            dev = torch.empty_strided(_local(v).shape, _local(v).stride(), dtype=v.dtype,
                                      device=_local(p).device)
            dev.copy_(_local(v))
            state[key] = _rewrap(v, dev)

    def close(self) -> None:
        """Remove the hooks (the files stay until exit)."""
        self._pre.remove()
        self._post.remove()
