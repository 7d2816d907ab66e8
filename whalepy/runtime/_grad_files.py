"""Gradient shards of the disk tier's parameters in files (``param_tier = nvme``).

FSDP2 with ``CPUOffloadPolicy`` copies each reduce-scattered gradient shard to the host and, when the
parameter already has a ``.grad``, adds it into that tensor in place
(``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``:
``sharded_param.grad._local_tensor += new_sharded_grad``); otherwise it keeps the copy as the new
gradient, in anonymous host memory. So before a block's backward, :meth:`GradFiles.attach` gives every
parameter of the block without a gradient a ``.grad`` DTensor whose local tensor is a view of a
**shared** file mapping (``torch.from_file(..., shared=True)``): dirty pages go to the file through the
page cache, not to anonymous memory. The file is zero without writing zeros: created, its blocks
allocated with ``os.posix_fallocate`` (they read as zeros; a full disk is a
:class:`~whalepy.errors.DiskSpaceError` here rather than a ``SIGBUS`` when a write into a hole of a
sparse file finds no block) and mapped, then unlinked at once, so its disk space is
freed when the last view of the mapping goes (after the block's optimizer step, :meth:`GradFiles.drop`,
or at ``zero_grad(set_to_none=True)``) and a crash leaves no gradient file behind.

Everything that reads gradients reads these like any tensor: gradient accumulation over micro-batches
(FSDP2 adds into them), fp16 unscaling (``ShardedGradScaler.unscale_``, in place), clipping
(:mod:`whalepy.runtime._clip`, in place). A parameter FSDP2 never reduced into in a backward (unused in
the forward: FSDP2 leaves its gradient ``None``) gets its attached zeros taken away again before the
step (:meth:`GradFiles.discard_untouched`), so the optimizer skips it as it would without the files.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from whalepy.runtime.disk_space import disk_full_error, is_disk_full

__all__ = ["GradFiles"]

_ALIGN = 64


class GradFiles:
    """The file-mapped gradient shards of the disk tier's blocks, one file per block and backward."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._blocks: dict[int, list[Any]] = {}  # block index -> FSDP2 FSDPParams
        self._attached: set[int] = set()  # ids of sharded params whose .grad is one of ours
        self._touched: set[int] = set()  # ... that FSDP2 has reduced into since
        self._live: dict[int, int] = {}  # id of a live mapping -> its bytes
        self._count = itertools.count()
        self._handles: list[Any] = []

    def add_block(self, index: int, fsdp_params: Sequence[Any]) -> None:
        self._blocks[index] = list(fsdp_params)
        for fp in fsdp_params:
            # FSDP2 calls a sharded parameter's post-accumulate-grad hooks after it reduced into .grad
            self._handles.append(fp.sharded_param.register_post_accumulate_grad_hook(self._mark))

    def close(self) -> None:
        """Remove the hooks (gradients attached now stay until dropped or zeroed to None)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _mark(self, param: torch.Tensor) -> None:
        self._touched.add(id(param))

    @property
    def nbytes(self) -> int:
        """Bytes of the gradient files alive now (their mappings are still referenced)."""
        return sum(self._live.values())

    @torch.no_grad()
    def attach(self, index: int) -> None:
        """Give the block's parameters without a gradient a zero gradient in a fresh shared mapping."""
        missing = [fp for fp in self._blocks.get(index, ()) if fp.sharded_param.grad is None]
        if not missing:
            return
        offsets, total = [], 0
        for fp in missing:
            offsets.append(total)
            nbytes = fp.sharded_size.numel() * fp.sharded_param.dtype.itemsize
            total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        buf = self._map(index, total) if total else torch.empty(0, dtype=torch.uint8)
        for fp, off in zip(missing, offsets, strict=True):
            dtype, size = fp.sharded_param.dtype, fp.sharded_size
            local = buf[off: off + size.numel() * dtype.itemsize].view(dtype).view(size)
            fp.sharded_param.grad = fp.to_sharded_dtensor(local)
            self._attached.add(id(fp.sharded_param))
            self._touched.discard(id(fp.sharded_param))

    def _map(self, index: int, nbytes: int) -> torch.Tensor:
        path = self.directory / f"b{index:04d}.grad{next(self._count)}.bin"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # blocks allocated now, reading as zeros (no zeros written where the file system supports
            # it): a full disk is an error here, not a SIGBUS when FSDP2 writes into a hole
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            if is_disk_full(e):
                raise disk_full_error(path, e, nbytes) from None
            raise
        os.close(fd)
        try:
            buf = torch.from_file(os.fspath(path), shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            os.unlink(path)  # the mapping keeps the file; its space goes with the last view
        key = id(buf)
        self._live[key] = nbytes
        weakref.finalize(buf, self._live.pop, key, None)
        return buf

    def is_file_grad(self, param: torch.Tensor) -> bool:
        """Whether ``param.grad`` is one of the attached file mappings."""
        return id(param) in self._attached and param.grad is not None

    def drop(self, index: int) -> None:
        """The block has stepped: its gradients go (with the last view, the mapping and its disk space)."""
        for fp in self._blocks.get(index, ()):
            if id(fp.sharded_param) in self._attached:
                fp.sharded_param.grad = None
                self._attached.discard(id(fp.sharded_param))

    def discard_untouched(self) -> None:
        """Attached gradients FSDP2 never reduced into (parameters unused in the forward) go back to None."""
        for fps in self._blocks.values():
            for fp in fps:
                key = id(fp.sharded_param)
                if key in self._attached and key not in self._touched:
                    fp.sharded_param.grad = None
                    self._attached.discard(key)
