"""The swap engine of the disk tier: tensors whose home is a file, staged per block through a bounded
pool of (pinned) host buffers by one background I/O thread.

PyTorch has no disk tier; what it does provide is used: ``torch.from_file`` maps a file as a tensor's
storage (read-only use, ``MAP_PRIVATE``: pages come from the page cache and cost no anonymous memory),
``Tensor.set_`` moves a tensor onto another storage while keeping its identity (so the optimizer's
parameters and state entries, FSDP2's shard tensors and DTensor wrappers all stay valid), and
``Tensor.pin_memory`` makes the staging buffers page-locked for asynchronous host-to-device copies.

Each *item* is one tensor storage (an FSDP2 shard of an nvme-tier parameter, or a tensor optimizer
state). Its *views* are the tensors over that storage (FSDP2's padded ``_sharded_param_data`` and the
parameter's local tensor). Between uses every view points at a private mapping of the item's current
file. A *block* (a plan block) owns items and one staging slot at most:

* ``prefetch(block)`` takes a slot and has the I/O thread read the block's files into it;
* ``stage(block)`` waits for that read and points the views at the slot (on the main thread);
* ``release(block, dirty=False)`` points the views back at the mappings and frees the slot;
  ``dirty=True`` (after the optimizer step) has the I/O thread write the slot to the files of the
  other generation (:func:`~whalepy.runtime._durable.atomic_write`), after which the views move to the
  new mappings and the slot is freed (:meth:`SwapEngine.settle`).

Every view is a host tensor, and only host storages (mappings, slots) are ever installed under it:
``Tensor.set_`` cannot move a tensor to another device (torch refuses a storage on another device
than the tensor's). An item with a ``device`` (an optimizer state of a device parameter) gets a
second tensor there while staged, :attr:`Item.on_device`, a copy of its slot bytes that the caller
steps with and that :meth:`SwapEngine.release` copies back into the slot before the write-back; the
views (what the optimizer holds between steps) stay on the host. The device may be the host itself
(a ``gpu`` parameter tier on a CPU run): the copy is then another host tensor, which is how the CPU
tests exercise this path.

:meth:`SwapEngine.commit` queues the manifest after a step's writes (one thread: in order), so the
manifest always names a complete generation, and after the manifest the removal of the generation it
supersedes: one generation at rest, two only while a step writes. A write that finds the file system
full (:class:`~whalepy.errors.DiskSpaceError`) stops what was queued after it (no manifest names an
incomplete generation) and, when the main thread meets it, :meth:`SwapEngine.abort` removes the files. The pool holds ``prefetch_depth + 2`` slots (the block in
use, ``prefetch_depth`` ahead, one being written back), each the size of the largest block's items:
that is the staging memory :func:`whalepy.cost_models.memory.estimate_model_state_bytes` charges.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from whalepy.errors import DiskSpaceError
from whalepy.ir.rules import staging_slots
from whalepy.runtime._durable import atomic_write, read_manifest, remove_files, remove_temporaries, write_manifest

__all__ = ["Item", "SwapEngine", "View"]

_ALIGN = 64


@dataclass
class View:
    """A tensor over an item's storage: ``tensor`` is moved with ``set_(storage, offset, size, stride)``."""

    tensor: torch.Tensor
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @staticmethod
    def of(t: torch.Tensor, offset: int = 0) -> View:
        return View(t, offset, tuple(t.shape), tuple(t.stride()))


@dataclass
class Item:
    """One file-homed storage of ``numel`` elements of ``dtype`` and the views over it."""

    name: str
    dtype: torch.dtype
    numel: int
    views: list[View]
    kind: str = "param"
    """``param`` (staged for forward, backward and the step) or ``state`` (for the step only)."""
    device: torch.device | None = None
    """None: the step uses the views themselves (host parameters and their states). A device (an
    optimizer state of a device parameter, the host on a CPU run): the step uses :attr:`on_device`, a
    copy on that device made at staging; the views stay host tensors."""
    mapped: torch.Tensor | None = None
    slot_offset: int = 0
    on_device: torch.Tensor | None = None
    """While staged (items with a ``device``): the copy the step uses, laid out as the first view."""

    def device_tensor(self) -> torch.Tensor:
        """:attr:`on_device`, made from the views' values first where it is missing (an item staged by
        :meth:`SwapEngine.capture`); the release copies it back into the slot."""
        if self.on_device is None:
            self.on_device = self.views[0].tensor.detach().to(self.device, copy=True)
        return self.on_device

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def point_at(self, storage: torch.UntypedStorage, elem_offset: int = 0) -> None:
        for v in self.views:
            if v.tensor.device != storage.device:
                raise RuntimeError(f"swap engine: item {self.name!r}: a view on {v.tensor.device} cannot be moved "
                                   f"onto a storage on {storage.device} (views are host tensors; device "
                                   "copies are Item.on_device)")
        with torch.no_grad():
            for v in self.views:
                v.tensor.set_(storage, elem_offset + v.offset, v.size, v.stride)


@dataclass
class _Block:
    index: int
    name: str
    items: list[Item] = field(default_factory=list)
    parity: int = 0
    slot: torch.Tensor | None = None
    loaded: set[str] = field(default_factory=set)
    on_slot: set[str] = field(default_factory=set)
    reading: Future | None = None
    writing: Future | None = None
    last_use: int = 0

    @property
    def nbytes(self) -> int:
        return sum(_aligned(it.nbytes) for it in self.items)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SwapEngine:
    """Blocks of file-homed tensors under ``directory``, staged through a pool of
    :func:`staging_slots` host buffers (pinned when ``pin``); see the module docstring."""

    def __init__(self, directory: Path, *, prefetch_depth: int = 1, pin: bool = False, fsync: bool = True,
                 keep: bool = False) -> None:
        self.directory = Path(directory)
        self.prefetch_depth = max(1, prefetch_depth)
        self.num_slots = staging_slots(prefetch_depth)
        self.pin = pin
        self.fsync = fsync
        self.keep = keep
        self.blocks: list[_Block] = []
        self.step_count = 0
        self.extra: dict = {}
        """JSON-able data committed with each manifest (the optimizer's scalar states)."""
        self._free: list[torch.Tensor] = []
        self._events: dict[int, Any] = {}  # staging buffer -> CUDA event after its last use
        self._allocated = 0
        self._clock = 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whalepy-nvme")
        self._commits: list[Future] = []  # the manifests and removals queued since last checked
        self._write_error: BaseException | None = None  # set by the I/O thread (:meth:`_submit_write`)
        self.aborted = False
        """A write found the file system full: the I/O thread is stopped and the files removed
        (:meth:`abort`); the tier cannot be used further."""
        remove_temporaries(self.directory)

    # -- layout ----------------------------------------------------------------------------------

    def add_block(self, name: str) -> int:
        self.blocks.append(_Block(index=len(self.blocks), name=name))
        return len(self.blocks) - 1

    def _file(self, block: _Block, item: Item, parity: int) -> Path:
        return self.directory / f"b{block.index:04d}.{item.name}.g{parity}.bin"

    def add_item(self, index: int, item: Item, *, write: bool = True) -> None:
        """Give ``item`` a home: write its values to its file of the block's current generation and
        point the views at the mapping (``write=False``: a restart, :meth:`resume` maps the files)."""
        block = self.blocks[index]
        if item.numel == 0:
            return
        block.items.append(item)
        if not write:
            self._layout(block)
            return
        data = _flat_of(item, item.views[0].tensor)
        path = self._file(block, item, block.parity)
        try:
            atomic_write(path, _bytes_of(data), fsync=self.fsync)
        except DiskSpaceError:
            self.abort()
            raise
        self._map(block, item, block.parity)
        self._layout(block)

    def _map(self, block: _Block, item: Item, parity: int) -> None:
        item.mapped = torch.from_file(os.fspath(self._file(block, item, parity)), shared=False,
                                      size=item.numel, dtype=item.dtype)
        item.point_at(item.mapped.untyped_storage())

    def _layout(self, block: _Block) -> None:
        off = 0
        for it in block.items:
            it.slot_offset = off
            off += _aligned(it.nbytes)

    # -- the pool --------------------------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        return max((b.nbytes for b in self.blocks), default=0)

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging buffers allocated (at most ``num_slots * slot_bytes``)."""
        return self._allocated

    @property
    def file_bytes(self) -> int:
        """Bytes of the named files (parameters and states; gradient files are unlinked once mapped)."""
        return sum(p.stat().st_size for p in self.directory.glob("*.bin"))

    def _take_slot(self, protect: set[int]) -> torch.Tensor | None:
        need = self.slot_bytes
        for s in self._free:  # the largest block grew (states appeared): smaller slots go
            if s.numel() < need:
                self._allocated -= s.numel()
        self._free = [s for s in self._free if s.numel() >= need]
        if self._free:
            return self._free.pop()
        in_pool = sum(1 for b in self.blocks if b.slot is not None) + len(self._free)
        if in_pool < self.num_slots:
            buf = torch.empty(need, dtype=torch.uint8)
            if self.pin:
                buf = buf.pin_memory()
            self._allocated += need
            return buf
        # make room, then try again: a write-back finishes (blocks not in use first), else the least
        # recently used clean block goes back to its mappings
        writing = sorted((b for b in self.blocks if b.writing is not None), key=lambda b: b.index in protect)
        if writing:
            self._settle_block(writing[0], wait=True)
            return self._take_slot(protect)
        victims = sorted((b for b in self.blocks if b.slot is not None and b.index not in protect),
                         key=lambda b: b.last_use)
        if not victims:
            return None
        self.release(victims[0].index)
        return self._take_slot(protect)

    def _give_back(self, block: _Block) -> None:
        if block.slot is not None and self.pin and torch.cuda.is_available():
            # a copy from this buffer to the device may still be queued (FSDP2 copies non-blocking):
            # the next read into it waits for this point of the stream first
            event = torch.cuda.Event()
            event.record()
            self._events[block.slot.data_ptr()] = event
        if block.slot is not None:
            others = sum(1 for b in self.blocks if b.slot is not None and b is not block) + len(self._free)
            if block.slot.numel() >= self.slot_bytes and others < self.num_slots:
                self._free.append(block.slot)
            else:  # too small for the largest block now, or one more than the pool holds
                self._allocated -= block.slot.numel()
            block.slot = None
        block.loaded.clear()
        block.on_slot.clear()

    # -- moving blocks ---------------------------------------------------------------------------

    def _items(self, block: _Block, kinds: Iterable[str]) -> list[Item]:
        kinds = set(kinds)
        return [it for it in block.items if it.kind in kinds]

    def prefetch(self, index: int, kinds: Iterable[str] = ("param",), protect: set[int] = frozenset()) -> None:
        """Start reading the block's ``kinds`` items into a staging slot (no-op when they are there)."""
        block = self._live_block(index)
        self._settle_block(block, wait=False)
        items = [it for it in self._items(block, kinds) if it.name not in block.loaded]
        if not items:
            return
        if block.writing is not None:
            self._settle_block(block, wait=True)
        if block.slot is None:
            slot = self._take_slot(set(protect) | {index})
            if slot is None:
                return  # no slot free: the block is used from its mapping
            block.slot = slot
        prev, parity, slot = block.reading, block.parity, block.slot
        paths = [(it, self._file(block, it, parity)) for it in items]
        block.loaded |= {it.name for it in items}
        block.reading = self._io.submit(_read_into, slot, paths, prev, self._events.pop(slot.data_ptr(), None))

    def stage(self, index: int, kinds: Iterable[str] = ("param",), protect: set[int] = frozenset()) -> None:
        """Point the block's ``kinds`` items at its staging slot (reading them first if needed)."""
        block = self.blocks[index]
        self._clock += 1
        block.last_use = self._clock
        if "state" in kinds:  # the step writes the slot: its previous write-back must be finished
            self._settle_block(block, wait=True)
        self.prefetch(index, kinds, protect)
        if block.slot is None:  # no buffer free: used from its mappings; a device item still needs its copy
            for it in self._items(block, kinds):
                if it.device is not None and it.on_device is None:
                    it.on_device = _to_device(it, _storage_tensor(it), non_blocking=False)
            return
        if block.reading is not None:
            self._result(block.reading)
            block.reading = None
        storage = block.slot.untyped_storage()
        for it in self._items(block, kinds):
            if it.name in block.loaded and it.name not in block.on_slot:
                it.point_at(storage, it.slot_offset // it.dtype.itemsize)
                if it.device is not None:
                    it.on_device = _to_device(it, _storage_tensor(it), non_blocking=self.pin)
                block.on_slot.add(it.name)

    def capture(self, index: int) -> None:
        """Stage the block from its tensors' current values rather than its files (they may have been
        written in place, e.g. by a checkpoint load, which a private mapping does not carry to the file)."""
        block = self.blocks[index]
        flats = {it.name: _flat_of(it, it.views[0].tensor) for it in block.items}
        for pending in (block.writing, block.reading):
            if pending is not None:
                self._result(pending)
        block.writing = block.reading = None
        if block.slot is None:
            # a buffer of its own, not one from the pool: making room there would send another block
            # back to its files and lose what was written into it in place (released when written back)
            buf = torch.empty(block.nbytes, dtype=torch.uint8)
            block.slot = buf.pin_memory() if self.pin else buf
            self._allocated += block.nbytes
        storage = block.slot.untyped_storage()
        for it in block.items:
            block.slot[it.slot_offset: it.slot_offset + it.nbytes].view(it.dtype).copy_(flats[it.name])
            it.point_at(storage, it.slot_offset // it.dtype.itemsize)
            block.loaded.add(it.name)
            block.on_slot.add(it.name)

    def adopt(self, index: int, item: Item, *, replace: Item | None = None,
              values: torch.Tensor | None = None) -> None:
        """A tensor that appeared during the step (a new optimizer state; ``replace``: one that a
        ``load_state_dict`` replaced): add it to the block's items and put it, with every item already
        staged, in the block's slot at the new layout, so the write-back gives it a file. ``values``
        (laid out as the item's first view, on any device): its values, when its views (host tensors)
        do not hold them yet. The slot then holds every staged item's latest values (device copies
        included), so :attr:`Item.on_device` is dropped."""
        block = self.blocks[index]
        flats = {it.name: _flat_of(it, it.on_device if it.on_device is not None else it.views[0].tensor)
                 for it in block.items if it.name in block.on_slot}
        if replace is not None:
            block.items[block.items.index(replace)] = item
            flats.pop(replace.name, None)
        elif item.numel:
            block.items.append(item)
        if item.numel:
            flats[item.name] = _flat_of(item, values if values is not None else item.views[0].tensor)
        self._layout(block)
        need = block.nbytes
        if block.slot is None:
            block.slot = self._take_slot({index})
        if block.slot is None or block.slot.numel() < need:
            old = block.slot.numel() if block.slot is not None else 0
            grown = torch.empty(need, dtype=torch.uint8)
            block.slot = grown.pin_memory() if self.pin else grown
            self._allocated += need - old
        storage = block.slot.untyped_storage()
        block.loaded.clear()
        block.on_slot.clear()
        for it in block.items:
            it.on_device = None
            if it.name in flats:
                block.slot[it.slot_offset: it.slot_offset + it.nbytes].view(it.dtype).copy_(flats[it.name])
                it.point_at(storage, it.slot_offset // it.dtype.itemsize)
                block.loaded.add(it.name)
                block.on_slot.add(it.name)

    def release(self, index: int, *, dirty: bool = False) -> None:
        """Done with the block: back to its mappings (``dirty``: written to the next generation first)."""
        block = self.blocks[index]
        if block.slot is None:
            if not (dirty and block.items):
                return
            self.capture(index)  # stepped on its mappings (no buffer was free): keep those values
        if block.reading is not None:
            self._result(block.reading)
            block.reading = None
        if not dirty:
            for it in block.items:
                it.on_device = None
                if it.name in block.on_slot:
                    it.point_at(it.mapped.untyped_storage())
            self._give_back(block)
            return
        parity = 1 - block.parity
        missing = [it for it in block.items if it.name not in block.on_slot]
        if missing:  # a dirty write covers every item: those not staged are read first
            self.stage(index, kinds=("param", "state"))
        for it in block.items:  # device copies back into the slot (synchronous copies)
            if it.on_device is not None:
                flat, v = _storage_tensor(it), it.views[0]
                flat.as_strided(v.size, v.stride, flat.storage_offset() + v.offset).copy_(it.on_device)
                it.on_device = None
        paths = [(it, self._file(block, it, parity)) for it in block.items]
        block.writing = self._submit_write(_write_from, block.slot, paths, self.fsync)
        block.parity = parity

    def settle(self, wait: bool = False) -> None:
        """Move blocks whose write-back finished onto their new mappings and free their slots."""
        self._check_commits(wait=wait)
        for b in self.blocks:
            self._settle_block(b, wait=wait)

    def _settle_block(self, block: _Block, *, wait: bool) -> None:
        if block.writing is None or (not wait and not block.writing.done()):
            return
        self._result(block.writing)
        block.writing = None
        for it in block.items:
            self._map(block, it, block.parity)
        self._give_back(block)

    def commit(self) -> None:
        """Queue the manifest of this step after its writes (the commit point of the generation), then
        the removal of the generation it supersedes: once the manifest is durable the files of the
        other parity are no longer named by it (one generation at rest, two only while a step writes)."""
        self.step_count += 1
        content = {"step": self.step_count, "extra": self.extra,
                   "blocks": [{"name": b.name, "parity": b.parity,
                               "items": {it.name: [str(it.dtype), it.numel, list(it.views[0].size),
                                                  list(it.views[0].stride)] for it in b.items}}
                              for b in self.blocks]}
        self._check_commits(wait=False)
        self._commits.append(self._submit_write(write_manifest, self.directory, content, fsync=self.fsync))
        stale = [self._file(b, it, 1 - b.parity) for b in self.blocks for it in b.items]
        self._commits.append(self._submit_write(remove_files, self.directory, stale, fsync=self.fsync))

    def drain(self) -> None:
        """Wait for every queued read, write, manifest and removal (the I/O thread runs them in order)."""
        self._live_block(None)
        self._result(self._io.submit(lambda: None))
        self._check_commits(wait=True)

    def _submit_write(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        """Queue a write, manifest or removal on the I/O thread; once one of them has failed, the ones
        queued after it fail with the same error without running: a manifest never names a generation
        whose files were not all written."""
        self._live_block(None)

        def run() -> Any:
            if self._write_error is not None:
                raise self._write_error
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                self._write_error = e
                raise
        return self._io.submit(run)

    def _live_block(self, index: int | None) -> Any:
        """Block ``index`` (None: nothing), or a :class:`DiskSpaceError` once the tier was aborted."""
        if self.aborted:
            raise DiskSpaceError(f"the disk tier under {os.fspath(self.directory)!r} stopped when its file system "
                                 "was full (the error before this one); its files are gone, so training cannot go "
                                 "on: free space there and start again")
        return None if index is None else self.blocks[index]

    def _result(self, future: Future) -> Any:
        """``future.result()``; a full file system (:class:`DiskSpaceError`, raised by the write in the I/O
        thread) aborts the tier first (:meth:`abort`)."""
        try:
            return future.result()
        except DiskSpaceError:
            self.abort()
            raise

    def _check_commits(self, *, wait: bool) -> None:
        """Raise what a queued manifest write or removal raised (nothing else waits for them)."""
        while self._commits and (wait or self._commits[0].done()):
            self._result(self._commits.pop(0))

    def abort(self) -> None:
        """After a write found the file system full: stop the I/O thread (queued work is cancelled) and
        remove the files, so a full disk is not left fuller; with ``keep`` only the temporary files (the
        last committed step stays for a restart, which removes the uncommitted generation)."""
        if self.aborted:
            return
        self.aborted = True
        self._io.shutdown(wait=True, cancel_futures=True)
        self._commits.clear()  # what was pending failed with this error, or never ran: said once
        for b in self.blocks:
            b.reading = b.writing = None
        if self.keep:
            remove_temporaries(self.directory)
        else:
            shutil.rmtree(self.directory, ignore_errors=True)

    def flush(self) -> None:
        """Wait for every queued read and write, settle, and give every slot back."""
        self.drain()
        self.settle(wait=True)
        for b in self.blocks:
            self.release(b.index)

    def close(self) -> None:
        """Finish the I/O; remove the files unless ``keep`` (after :meth:`abort`: nothing left to do)."""
        if self.aborted:
            return
        try:
            self.flush()
        finally:
            self._io.shutdown(wait=True)
            if not self.keep:
                shutil.rmtree(self.directory, ignore_errors=True)

    # -- restart ---------------------------------------------------------------------------------

    @staticmethod
    def last_manifest(directory: Path) -> dict | None:
        return read_manifest(Path(directory))

    def resume(self, manifest: dict) -> None:
        """Point the items at the files of ``manifest``'s generation (a restart after a crash): the
        blocks and items must be the ones the manifest names (same model and plan)."""
        from whalepy.errors import WhalepyError

        saved = manifest["blocks"]
        if [b["name"] for b in saved] != [b.name for b in self.blocks]:
            raise WhalepyError(f"nvme_dir {os.fspath(self.directory)!r} holds the disk tier of other blocks "
                               f"({[b['name'] for b in saved][:3]}...); resume with the same model and plan "
                               "or use an empty nvme_dir")
        for b, s in zip(self.blocks, saved):
            b.parity = s["parity"]
            for it in b.items:
                if s["items"].get(it.name, [None, None])[:2] != [str(it.dtype), it.numel]:
                    raise WhalepyError(f"nvme_dir file {it.name!r} of block {b.name!r} does not match this "
                                       "model (another model or plan wrote it); use an empty nvme_dir")
                self._map(b, it, b.parity)
        self.step_count = manifest["step"]
        self.extra = manifest.get("extra", {})


def _storage_tensor(item: Item) -> torch.Tensor:
    """The item's flat storage (``numel`` elements where its views now point: a slot or a mapping)."""
    v = item.views[0]
    t = v.tensor
    return torch.empty(0, dtype=item.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() - v.offset, (item.numel,), (1,))


def _to_device(item: Item, flat: torch.Tensor, *, non_blocking: bool) -> torch.Tensor:
    """The item's values (``flat``: its host storage) as a new tensor on ``item.device``, laid out as
    its first view."""
    v = item.views[0]
    dev = torch.empty(item.numel, dtype=item.dtype, device=item.device)
    dev.copy_(flat, non_blocking=non_blocking)
    return dev.as_strided(v.size, v.stride, v.offset)


def _flat_of(item: Item, t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (laid out as the item's first view) as the item's flat storage."""
    v = item.views[0]
    flat = torch.zeros(item.numel, dtype=item.dtype)
    flat.as_strided(v.size, v.stride, v.offset).copy_(t.detach())
    return flat


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _read_into(slot: torch.Tensor, paths: list[tuple[Item, Path]], prev: Future | None,
               free_after: Any = None) -> None:
    if prev is not None:
        prev.result()
    if free_after is not None:
        free_after.synchronize()
    buf = slot.numpy()
    for it, path in paths:
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf[it.slot_offset: it.slot_offset + it.nbytes])
            got = 0
            while got < it.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{path} is shorter than {it.nbytes} bytes")
                got += n


def _write_from(slot: torch.Tensor, paths: list[tuple[Item, Path]], fsync: bool) -> None:
    buf = slot.numpy()
    for it, path in paths:
        atomic_write(path, memoryview(buf[it.slot_offset: it.slot_offset + it.nbytes]), fsync=fsync)
