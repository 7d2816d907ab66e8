"""The ``nvme`` tier: optimizer states (ZeRO-Infinity's optimizer offload) and parameters
(ZeRO-Infinity's parameter offload) kept in files, swapped per block through pinned staging buffers.

PyTorch has no disk tier, so whalepy adds one around FSDP2 and the user's optimizer
(:mod:`whalepy.runtime._swap` moves the bytes, :mod:`whalepy.runtime._durable` makes them durable):

* ``optimizer_tier = nvme``: the tensor states of the block's parameters (AdamW's ``exp_avg`` /
  ``exp_avg_sq``: the local shards under FSDP2, whole tensors under DDP) live in files between steps.
  The optimizer step runs **per block**: block ``i``'s states are read into a staging slot, the
  optimizer steps over block ``i``'s parameters only, and the updated states are written back by the
  I/O thread while block ``i + 1`` steps; the next ``prefetch_depth`` blocks are read ahead meanwhile.
  The states of **device parameters** (``param_tier = gpu``) are host tensors too between steps: for
  the block's step the optimizer's state entries are swapped for copies on the parameters' device
  (:attr:`~whalepy.runtime._swap.Item.on_device`) and swapped back after it, the updated values
  copied into the slot first (a tensor cannot be moved to another device in place). On a CPU run the
  "device" is the host and the copies are host tensors: the same path, which the CPU tests run.
* ``param_tier = nvme``: the block's FSDP2 shards (host shards: FSDP2's ``CPUOffloadPolicy``) live in
  files too. Forward pre-hooks (and, for backward, hooks on the blocks' outputs, in reverse order)
  stage block ``i`` and read the next ``prefetch_depth`` blocks in the direction of travel, so FSDP2's
  all-gather of block ``i`` copies from a staging slot while the I/O thread reads the blocks after it;
  FSDP2's own prefetching (:func:`whalepy.runtime.data_parallel.set_prefetch`) moves the next block to
  the device. The updated shards are written back with the states after the step. Their gradient
  shards live in files too (:mod:`whalepy.runtime._grad_files`): before the block's backward each
  parameter gets a ``.grad`` over a shared mapping of a fresh sparse file, which FSDP2's post-backward
  adds the reduced shard into; after the block's optimizer step they are dropped (the parameters'
  ``.grad`` is None again, as after ``zero_grad(set_to_none=True)``), before its new generation is
  written.

Between steps every file-homed tensor is a view of a private (read-only use) mapping of its current
file, so ``optimizer.state_dict()``, ``get_state_dict`` and DCP read it like any other tensor
(checkpoints are unchanged). After ``optimizer.load_state_dict`` (fresh tensors), or any write into
these tensors in place outside a step (``pm.load`` and ``pm.load_state_dict`` do it themselves), call
:meth:`NvmeTier.offload`: a private mapping does not carry such writes to the file. Scalar states (AdamW's ``step``) stay in memory and are
recorded in the manifest. Files are written atomically under the other generation's names with a
manifest as commit point; once the manifest is durable the superseded generation is removed, so the
disk holds one generation between steps and two only while a step writes (docs/runtime.md, "Disk
tier"; the peak: :func:`whalepy.ir.rules.disk_tier_file_bytes`). The directory is removed at exit
unless ``keep``. Before anything is written, the peak files of every rank on the file system are
summed against its free space (:mod:`whalepy.runtime.disk_space`); a disk found full later is a
:class:`~whalepy.errors.DiskSpaceError`, and the files go with it (:meth:`SwapEngine.abort`).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from whalepy.errors import DiskSpaceError
from whalepy.runtime._durable import prepare_dir
from whalepy.runtime._torch_compat import fsdp_param_groups
from whalepy.runtime._grad_files import GradFiles
from whalepy.runtime._swap import Item, SwapEngine, View

__all__ = ["NvmeOptimizerStates", "NvmeTier", "build_nvme_tier", "default_nvme_dir", "prepare_nvme_dir"]

_counter = itertools.count()
_BOTH = ("param", "state")


def default_nvme_dir(root: str | os.PathLike[str] | None, rank: int, *, stable: bool = False) -> Path:
    """This process's directory for its disk tier: ``<root>/whalepy-nvme-<pid>-rank<r>`` (a ``-<n>``
    suffix for the second and later tiers of the process); ``stable`` (files kept for a restart):
    ``<root>/whalepy-nvme-rank<r>``. ``root`` defaults to :func:`tempfile.gettempdir`."""
    base = Path(root) if root is not None else Path(tempfile.gettempdir())
    if stable:
        return base / f"whalepy-nvme-rank{rank}"
    n = next(_counter)
    return base / (f"whalepy-nvme-{os.getpid()}-rank{rank}" + (f"-{n}" if n else ""))


def prepare_nvme_dir(path: Path, *, user_dir: str | os.PathLike[str] | None = None, keep: bool = False) -> Path:
    """Create ``path``, check it is writable (:class:`WhalepyError` naming it otherwise) and, unless
    ``keep``, remove it at interpreter exit."""
    return prepare_dir(Path(path), user_dir=user_dir, keep=keep)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in the DTensor form of ``like`` (same spec), built as FSDP2 builds its CPU shards."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    return DTensor(local, like._spec, requires_grad=False)


def _span(t: torch.Tensor) -> int:
    """Elements of storage a tensor of ``t``'s sizes and strides needs."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))


class NvmeTier:
    """Blocks whose parameters and / or optimizer states live in files under ``directory`` (see the
    module docstring). Add blocks in model order with :meth:`add_block`, then :meth:`install`."""

    def __init__(self, optimizer: torch.optim.Optimizer, directory: Path, *, prefetch_depth: int = 1,
                 pin: bool = False, keep: bool = False, fsync: bool = True) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # under ZeRO-1 the states live in the wrapped per-rank optimizer, which ZeRO's step calls
        self.optimizer = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        self.directory = Path(directory)
        self.engine = SwapEngine(self.directory, prefetch_depth=prefetch_depth, pin=pin, fsync=fsync, keep=keep)
        self.grads = GradFiles(self.directory)
        self._params: list[list[nn.Parameter]] = []  # per block, the optimizer's parameters
        self._states: list[bool] = []
        self._state_device: list[torch.device | None] = []  # per block: where its states are stepped
        self._param_blocks: list[int] = []  # blocks with file-homed parameters, in model order
        self._handles: list[Any] = []
        self._step = None

    # -- setup -------------------------------------------------------------------------------------

    def add_block(self, name: str, params: Iterable[nn.Parameter], *, fsdp_params: Sequence[Any] = (),
                  modules: Sequence[nn.Module] = (), states: bool = True, write: bool = True,
                  device_params: bool | None = None) -> int:
        """A block: ``params`` are stepped together; with ``states`` their optimizer states live in
        files; ``fsdp_params`` (FSDP2 ``FSDPParam``s of host-offloaded shards) live in files too, staged
        around the forward and backward of ``modules``. ``device_params``: the parameters live on the
        device (``param_tier = gpu``), so their states are stepped as copies on the parameters' device
        (see the module docstring); None: when they are not host tensors."""
        i = self.engine.add_block(name)
        self._params.append(list({id(p): p for p in params}.values()))
        self._states.append(states)
        device = _local(self._params[-1][0]).device if self._params[-1] else None
        if device_params is None:
            device_params = device is not None and device.type != "cpu"
        self._state_device.append(device if device_params else None)
        for k, fp in enumerate(fsdp_params):
            flat, local = fp._sharded_param_data, fp.sharded_param._local_tensor
            if flat.device.type != "cpu":
                raise ValueError("param_tier='nvme' needs FSDP2's CPUOffloadPolicy (host shards)")
            views = [View.of(flat), View(local, local.storage_offset() - flat.storage_offset(),
                                         tuple(local.shape), tuple(local.stride()))]
            self.engine.add_item(i, Item(f"p{k}", flat.dtype, flat.numel(), views), write=write)
        if fsdp_params:
            self._param_blocks.append(i)
            self.grads.add_block(i, fsdp_params)
            for m in modules:
                self._handles.append(m.register_forward_pre_hook(self._pre_forward(i), prepend=True))
                self._handles.append(m.register_forward_hook(self._post_forward(i), prepend=True))
        return i

    def install(self) -> None:
        """Replace the optimizer's ``step`` by the per-block step; commit generation 0."""
        if self._step is None:
            from whalepy.ir.rules import staging_slots

            self.engine.num_slots = staging_slots(self.engine.prefetch_depth, len(self.engine.blocks))
            self._step = self.optimizer.step
            self.optimizer.step = self.step  # type: ignore[method-assign]
            self.engine.commit()

    def close(self) -> None:
        """Remove the hooks, finish the I/O, remove the files unless ``keep``."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.grads.close()
        if self._step is not None:
            self.optimizer.step = self._step  # type: ignore[method-assign]
            self._step = None
        self.engine.close()

    # -- forward / backward ----------------------------------------------------------------------

    def _use(self, i: int, forward: bool) -> None:
        order = self._param_blocks
        pos = order.index(i)
        d = self.engine.prefetch_depth
        ahead = order[pos + 1: pos + 1 + d] if forward else order[max(0, pos - d): pos][::-1]
        protect = {i, *ahead}
        self.engine.settle()
        self.engine.stage(i, ("param",), protect)
        for j in ahead:
            self.engine.prefetch(j, ("param",), protect)

    def _pre_forward(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._use(i, forward=True)
        return hook

    def _post_forward(self, i: int) -> Any:
        def on_grad(grad: torch.Tensor) -> None:
            self._use(i, forward=False)
            try:
                self.grads.attach(i)  # before FSDP2's post-backward reduces into the block's gradients
            except DiskSpaceError:
                self.engine.abort()  # the files go: a full disk is not left fuller
                raise

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(on_grad)
        return hook

    # -- the step ----------------------------------------------------------------------------------

    def step(self, closure: Any = None) -> Any:
        """The optimizer step, block by block (see the module docstring): the optimizer's ``step`` runs
        once for the parameters outside the tier and once per tier block (its step hooks with it);
        ``closure`` is evaluated once, first."""
        opt, eng = self.optimizer, self.engine
        groups = opt.param_groups
        full = [g["params"] for g in groups]
        tiered = {id(p) for ps in self._params for p in ps}
        loss = None
        if closure is not None:  # evaluated once, not once per block
            with torch.enable_grad():
                loss = closure()
        self.grads.discard_untouched()
        try:
            for g, ps in zip(groups, full, strict=True):
                g["params"] = [p for p in ps if id(p) not in tiered]
            if any(g["params"] for g in groups):
                self._step()
            order = list(range(len(self._params)))
            d = eng.prefetch_depth
            eng.settle()
            for pos, i in enumerate(order):
                ahead = order[pos + 1: pos + 1 + d]
                protect = {i, *ahead}
                eng.stage(i, _BOTH, protect)
                for j in ahead:
                    eng.prefetch(j, _BOTH, protect)
                mine = {id(p) for p in self._params[i]}
                for g, ps in zip(groups, full, strict=True):
                    g["params"] = [p for p in ps if id(p) in mine]
                self._states_to(i, device=True)
                self._step()
                self.grads.drop(i)  # before the block's new generation is written: the disk peak
                self._adopt(i)  # the states back on the host, new ones given a home
                eng.release(i, dirty=True)
        finally:
            for g, ps in zip(groups, full, strict=True):
                g["params"] = ps
        eng.extra = {"scalars": self._scalars()}
        eng.commit()
        return loss

    def _state_items(self, i: int) -> Iterable[tuple[dict[str, Any], str, Item]]:
        """``(the parameter's state dict, key, item)`` of block ``i``'s file-homed tensor states."""
        by_name = {it.name: it for it in self.engine.blocks[i].items if it.kind == "state"}
        for k, p in enumerate(self._params[i]):
            state = self.optimizer.state.get(p, {})
            for key in list(state):
                it = by_name.get(f"s{k}.{key}")
                if it is not None:
                    yield state, key, it

    def _states_to(self, i: int, *, device: bool) -> None:
        """Block ``i``'s state entries for device parameters: their staged copies on the device
        (``device``, for the step) or their host views (between steps)."""
        if self._state_device[i] is None:
            return
        for state, key, it in self._state_items(i):
            if it.device is None:
                continue
            local = it.device_tensor() if device else it.views[0].tensor
            if _local(state[key]) is not local:
                state[key] = _rewrap(state[key], local)

    def _adopt(self, i: int) -> None:
        """Give new (first step) or replaced (``load_state_dict``) tensor states of block ``i`` a home;
        the states of device parameters go back to their host views."""
        if not self._states[i]:
            return
        block = self.engine.blocks[i]
        by_name = {it.name: it for it in block.items}
        staged = {it.name: it.on_device for it in block.items}  # adopt() below drops the device copies
        device = self._state_device[i]
        for k, p in enumerate(self._params[i]):
            for key, v in self.optimizer.state.get(p, {}).items():
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    continue
                loc = _local(v)
                name = f"s{k}.{key}"
                old = by_name.get(name)
                if old is not None and (old.views[0].tensor is loc or staged.get(name) is loc):
                    continue
                if device is None:  # a host state: the tensor itself becomes the view
                    view, values = loc, None
                else:  # a device state: a new host tensor becomes the view, ``loc`` gives its values
                    view, values = torch.empty(0, dtype=loc.dtype), loc
                item = Item(name, loc.dtype, _span(loc), [View(view, 0, tuple(loc.shape), tuple(loc.stride()))],
                            kind="state", device=device)
                self.engine.adopt(i, item, replace=old, values=values)
        self._states_to(i, device=False)

    def _scalars(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for i, ps in enumerate(self._params):
            for k, p in enumerate(ps):
                for key, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() == 0:
                        out.setdefault(f"{i}.{k}", {})[key] = float(v)
        return out

    @torch.no_grad()
    def offload(self) -> None:
        """Write the current values of parameters and states (a checkpoint load may have written them
        in place, or replaced the state tensors) to their files. Block by block, and no block goes back
        to its files before its own values are taken (:meth:`SwapEngine.capture`)."""
        for i in range(len(self._params)):
            self.engine.capture(i)
            self._adopt(i)
            self.engine.release(i, dirty=True)
        self.engine.commit()
        self.engine.flush()

    def resume(self) -> bool:
        """Point parameters and optimizer states at the last committed generation in ``directory`` (a
        restart after a crash with ``keep``); False when there is none. Tensor states take the
        parameter's layout (AdamW's states do)."""
        manifest = self.engine.last_manifest(self.directory)
        if manifest is None or manifest.get("step", 0) < 1:
            return False
        self.engine.resume(manifest)
        scalars = manifest.get("extra", {}).get("scalars", {})
        for i, (ps, saved) in enumerate(zip(self._params, manifest["blocks"], strict=True)):
            for name, (dtype, numel, size, stride) in saved["items"].items():
                if not name.startswith("s"):
                    continue
                k, key = name[1:].split(".", 1)
                p = ps[int(k)]
                dt = getattr(torch, dtype.split(".")[-1])
                local = torch.empty(0, dtype=dt)  # pointed at the file's mapping just below
                self.optimizer.state.setdefault(p, {})[key] = _rewrap(p, local)
                item = Item(name, dt, numel, [View(local, 0, tuple(size), tuple(stride))], kind="state",
                            device=self._state_device[i])
                self.engine.blocks[i].items.append(item)
                self.engine._map(self.engine.blocks[i], item, self.engine.blocks[i].parity)
            self.engine._layout(self.engine.blocks[i])
            for k, p in enumerate(ps):
                for key, val in scalars.get(f"{i}.{k}", {}).items():
                    self.optimizer.state.setdefault(p, {})[key] = torch.tensor(val, dtype=torch.float32)
        return True

    # -- inspection ---------------------------------------------------------------------------------

    def files(self) -> list[Path]:
        """The named files of the tier: one generation between steps, two while a step writes (the
        gradient files are unlinked once mapped: :attr:`GradFiles.nbytes`)."""
        return sorted(self.directory.glob("*.bin"))

    @property
    def nbytes(self) -> int:
        """Bytes of optimizer state held in files (one generation)."""
        return sum(it.nbytes for b in self.engine.blocks for it in b.items if it.kind == "state")

    @property
    def param_nbytes(self) -> int:
        """Bytes of parameter shards held in files (one generation)."""
        return sum(it.nbytes for b in self.engine.blocks for it in b.items if it.kind == "param")

    def is_mapped(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a DTensor's local tensor) is a view of one of the parameter / state file
        mappings (gradients: :meth:`GradFiles.is_file_grad`)."""
        ptr = _local(t).untyped_storage().data_ptr()
        return any(it.mapped is not None and it.mapped.untyped_storage().data_ptr() == ptr
                   for b in self.engine.blocks for it in b.items)


def NvmeOptimizerStates(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter], directory: Path,
                        *, device_params: bool | None = None, **kwargs: Any) -> NvmeTier:  # noqa: N802
    """A tier of one block: the optimizer states of ``params`` in files under ``directory``
    (``device_params``: :meth:`NvmeTier.add_block`)."""
    tier = NvmeTier(optimizer, directory, **kwargs)
    tier.add_block("states", params, device_params=device_params)
    tier.install()
    return tier


def build_nvme_tier(optimizer: torch.optim.Optimizer, blocks: Sequence[tuple[Any, nn.Module, Sequence[nn.Module]]],
                    *, rank: int, nvme_dir: str | os.PathLike[str] | None, keep: bool = False, pin: bool = False,
                    planned_file_bytes: float = 0.0) -> NvmeTier:
    """The disk tier of this rank for ``blocks`` (``(BlockPlan, wrapped root, block modules)`` in model
    order, after FSDP2 and materialisation): checks, before anything is created or written, that the
    files of every rank on this file system fit at their peak (collective:
    :func:`~whalepy.runtime.disk_space.check_disk_tier_space`, which ranks without a disk tier call with
    0 bytes), then the directory, homes the blocks' parameter shards (``param_tier = nvme``) and optimizer
    states (``optimizer_tier = nvme``) in files and, with ``keep``, resumes the last committed step there."""
    from whalepy.ir.rules import disk_tier_file_bytes, stage_tiers_error
    from whalepy.errors import WhalepyError
    from whalepy.cost_models.memory import ADAM_STATE_BYTES_PER_PARAM, MASTER_GRAD_BYTES, MASTER_PARAM_BYTES
    from whalepy.ir.plan import Tier
    from whalepy.runtime.data_parallel import fsdp_units
    from whalepy.runtime.disk_space import check_disk_tier_space

    seen: set[int] = set()
    layout = []
    need = grads = 0.0
    for bp, root, mods in blocks:
        params = [p for m in mods for p in m.parameters() if id(p) not in seen]
        seen |= {id(p) for p in params}
        units = fsdp_units(root, mods) if bp.param_tier is Tier.NVME else []
        fsdp_params = [fp for u in units for g in fsdp_param_groups(u) for fp in g.fsdp_params]
        per_param = ((MASTER_PARAM_BYTES if fsdp_params else 0)
                     + (ADAM_STATE_BYTES_PER_PARAM if bp.optimizer_tier is Tier.NVME else 0))
        need += per_param * sum(_local(p).numel() for p in params)
        grads += MASTER_GRAD_BYTES * sum(fp.sharded_size.numel() for fp in fsdp_params)
        layout.append((bp, params, fsdp_params, units))
    peak = disk_tier_file_bytes(need, grads).peak
    reason = stage_tiers_error(bp for bp, _, _ in blocks)
    if reason is not None:  # a Plan refuses it when made; blocks handed over directly are checked here
        raise WhalepyError(reason)
    check_disk_tier_space(nvme_dir, max(peak, planned_file_bytes), rank=rank)
    directory = prepare_nvme_dir(default_nvme_dir(nvme_dir, rank, stable=keep), user_dir=nvme_dir, keep=keep)
    depth = next((bp.prefetch_depth for bp, _, fps, _ in layout if fps), 1)
    tier = NvmeTier(optimizer, directory, prefetch_depth=depth, pin=pin, keep=keep)
    resuming = keep and (tier.engine.last_manifest(directory) or {}).get("step", 0) >= 1
    for bp, params, fsdp_params, units in layout:
        tier.add_block(bp.name, params, fsdp_params=fsdp_params, modules=units,
                       states=bp.optimizer_tier is Tier.NVME, write=not resuming,
                       device_params=bp.param_tier is Tier.GPU)
    if resuming:
        tier.resume()
    tier.install()
    return tier
