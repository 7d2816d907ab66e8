"""Deferred initialisation: a model built on the meta device gets only this rank's shards, filled in place.

torchtitan's pattern (style.md §10): build under ``torch.device("meta")``, lower the plan (pipeline
split, DTensor TP, FSDP2) on the meta model, then allocate this rank's local tensors
(``nn.Module._apply`` with ``torch.empty_like``, what ``to_empty`` does; FSDP2 re-pads its shards in
its own ``_apply``) and fill them from one of three sources:

- **initialisation** (default). Every tensor's FULL value is generated on the host, one module at a
  time, by that module's own initialiser run on a host copy of it (``init_fn(module)`` when given,
  otherwise ``module.reset_parameters()`` and then the root model's ``_init_weights(module)``, which is
  HF's per-module initialiser and also recomputes HF's rotary tables; under transformers 4.x, whose
  ``_init_weights`` does not, ``whalepy.models.hf_compat.init_rotary_tables`` does). The random generator is seeded
  from ``(seed, module path)``, so the values depend neither on the plan nor on the rank, and a
  single process (:func:`materialize`) gets the same weights. Only this rank's slice is kept.
- **safetensors** (HF ``save_pretrained`` output: one file, or shards with
  ``model.safetensors.index.json``): each local tensor reads only its slice with
  ``safe_open(...).get_slice``.
- **DCP** (a ``torch.distributed.checkpoint`` directory, e.g. ``ParallelModel.save``): DCP reads each
  rank's chunks itself (:func:`whalepy.runtime.checkpointing.load_model_state`).

Buffers that were on the meta device (rotary tables, masks) always come from the initialisation path
(non-persistent ones are in no checkpoint); tensors that were not on the meta device keep their values.
The bytes held are recorded (:class:`MaterializeStats`): this rank's share after allocation, plus the
largest host module copy alive at a time.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from whalepy.errors import WhalepyError
from whalepy.models.hf_compat import init_rotary_tables, relink_original_inv_freq

__all__ = ["MaterializeStats", "Skeleton", "checkpoint_kind", "has_meta_tensors", "materialize",
           "materialize_modules", "snapshot"]

InitFn = Callable[[nn.Module], None]


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


@dataclass(frozen=True)
class MaterializeStats:
    """What materialisation held on this rank, in bytes (parameters only)."""

    share_bytes: int
    """This rank's parameter storage after allocation (FSDP2's padded shards included)."""
    peak_bytes: int
    """The most parameter bytes held at once: the share plus the largest host module copy."""
    largest_unit_bytes: int
    """Parameter bytes of the largest module generated whole on the host, or of the largest slice
    read from safetensors (a DCP load's transient buffers are DCP's and not counted)."""
    num_tensors: int
    """Local tensors filled."""


@dataclass
class Skeleton:
    """The meta model as built, before lowering changed it (a deep copy; meta tensors hold no memory):
    the module each tensor is initialised through, and the first name of every tied parameter."""

    root: nn.Module
    canonical: dict[str, str]
    """Every parameter and buffer name -> the first name of that tensor (tied weights share one)."""
    meta_names: frozenset[str]
    """Names of the tensors that were on the meta device (the only ones filled)."""


def snapshot(model: nn.Module) -> Skeleton:
    """Record ``model`` before lowering (call it first: TP and FSDP2 replace parameters)."""
    root = copy.deepcopy(model)
    canonical: dict[str, str] = {}
    first: dict[int, str] = {}
    meta: set[str] = set()
    named = list(root.named_parameters(remove_duplicate=False)) + list(
        root.named_buffers(remove_duplicate=False))
    for name, t in named:
        canonical[name] = first.setdefault(id(t), name)
        if t.is_meta:
            meta.add(name)
    return Skeleton(root=root, canonical=canonical, meta_names=frozenset(meta))


def checkpoint_kind(path: str | Path) -> str:
    """``"dcp"`` or ``"safetensors"``; :class:`WhalepyError` when ``path`` is neither (checked before
    the model is lowered)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return "safetensors"
    if p.is_dir():
        if (p / ".metadata").is_file():
            return "dcp"
        if (p / "model.safetensors.index.json").is_file() or any(p.glob("*.safetensors")):
            return "safetensors"
    raise WhalepyError(
        f"checkpoint={str(path)!r} is neither a torch.distributed.checkpoint directory (with a .metadata "
        "file) nor HF safetensors (a .safetensors file, or a directory with model.safetensors or "
        "model.safetensors.index.json); pass one of those")


# -- where each local element comes from -------------------------------------------------------


def _on_dim(placement: Any, dim: int) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor) if placement.dim == dim else Replicate()
    if isinstance(placement, Shard):
        return Shard(0) if placement.dim == dim else Replicate()
    return Replicate()


def local_index(t: torch.Tensor, cache: dict | None = None) -> tuple[slice | torch.Tensor, ...]:
    """For each dim of ``t``'s global shape, the global indices this rank's local tensor holds: a
    ``slice`` when they are contiguous, else an index tensor. Derived by distributing an ``arange``
    with ``t``'s placements restricted to that dim (no communication: ``src_data_rank=None``), so
    it follows DTensor's own rules, ``_StridedShard`` (FSDP2 x TP) included. ``cache`` (one per
    materialisation: the meshes it holds stay alive) saves the work for tensors laid out alike."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(t, DTensor):
        return tuple(slice(None) for _ in t.shape)
    out: list[slice | torch.Tensor] = []
    mesh = t.device_mesh
    cache = {} if cache is None else cache
    for d, n in enumerate(t.shape):
        places = tuple(_on_dim(p, d) for p in t.placements)
        key = (n, places, mesh)
        if key not in cache:
            if all(p.is_replicate() for p in places):
                cache[key] = slice(None)
            else:
                held = distribute_tensor(torch.arange(n, device=mesh.device_type), mesh, places,
                                         src_data_rank=None).to_local().cpu()
                if held.numel() == 0:
                    cache[key] = slice(0, 0)
                elif torch.equal(held, torch.arange(int(held[0]), int(held[0]) + held.numel())):
                    cache[key] = slice(int(held[0]), int(held[0]) + held.numel())
                else:
                    cache[key] = held
        out.append(cache[key])
    return tuple(out)


def take(full: torch.Tensor, index: Sequence[slice | torch.Tensor]) -> torch.Tensor:
    """``full`` restricted to ``index`` (one entry per dim, as :func:`local_index` gives)."""
    for d, ix in enumerate(index):
        full = full.index_select(d, ix) if isinstance(ix, torch.Tensor) else full[(slice(None),) * d + (ix,)]
    return full


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _fill(target: torch.Tensor, value: torch.Tensor, name: str) -> None:
    local = _local(target)
    if tuple(value.shape) != tuple(local.shape):
        raise WhalepyError(f"{name}: the source gives shape {tuple(value.shape)} for this rank's part, "
                           f"the model holds {tuple(local.shape)}; the checkpoint is of another model")
    if local.dtype.is_floating_point != value.dtype.is_floating_point or \
            local.dtype.is_complex != value.dtype.is_complex:  # a float <-> int cast would be silent and wrong
        raise WhalepyError(f"{name}: the checkpoint holds it as {value.dtype}, the model as {local.dtype}; a "
                           "checkpoint of integer tensors is not a model's weights (another file, or a "
                           "conversion that lost the dtype): give the model's own checkpoint")
    local.copy_(value.to(device=local.device, dtype=local.dtype))


# -- sources -----------------------------------------------------------------------------------


def unit_seed(seed: int, path: str) -> int:
    """The generator seed of module ``path``: a stable hash of ``(seed, path)``."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _host_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose own tensors are fresh host tensors of the full shape (its
    children stay meta: a module's initialiser fills its own tensors)."""
    host = copy.copy(module)
    host._parameters = {k: None if p is None else nn.Parameter(torch.empty_like(p, device="cpu"),
                                                               requires_grad=p.requires_grad)
                        for k, p in module._parameters.items()}
    host._buffers = {k: None if b is None else (torch.empty_like(b, device="cpu") if b.is_meta else b.cpu())
                     for k, b in module._buffers.items()}
    host._modules = dict(module._modules)
    return host


def init_module(skeleton: Skeleton, path: str, *, seed: int, init_fn: InitFn | None) -> nn.Module:
    """Host copy of module ``path`` with its tensors initialised (see the module docstring)."""
    source = skeleton.root.get_submodule(path)
    host = _host_copy(source)
    # buffers allocated empty for meta ones: each must be written (in place, or replaced) by an initialiser
    empty = {k: (b, b._version) for k, b in host._buffers.items()
             if b is not None and source._buffers.get(k) is not None and source._buffers[k].is_meta}
    root_init = getattr(skeleton.root, "_init_weights", None)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(unit_seed(seed, path))
        if init_fn is not None:
            try:
                init_fn(host)
            except Exception as e:  # noqa: BLE001 - the user's code: one line, printed once per job
                from whalepy.errors import WhalepyError

                text = " ".join(str(e).split())[:200]
                raise WhalepyError(f"init_fn raised {type(e).__name__}: {text} (on module {path!r}, a "
                                   f"{type(host).__name__}); fix init_fn or leave it out for each module's "
                                   "reset_parameters()") from e
        else:
            if callable(getattr(host, "reset_parameters", None)):
                host.reset_parameters()
            if callable(root_init):
                root_init(host)
            init_rotary_tables(host)  # transformers 4.x: _init_weights leaves them alone
    host._whalepy_unset_buffers = [k for k, (b, v) in empty.items()  # type: ignore[attr-defined]
                                   if host._buffers.get(k) is b and b._version == v]
    return host


class _Safetensors:
    """HF safetensors files opened lazily; reads one tensor's slice at a time."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, Any] = {}
        if p.is_dir() and (p / "model.safetensors.index.json").is_file():
            weight_map = json.loads((p / "model.safetensors.index.json").read_text())["weight_map"]
            self.where = {k: p / f for k, f in weight_map.items()}
            missing = sorted({f for f in self.where.values() if not f.is_file()})
            if missing:  # checked before any tensor is read, on every rank alike
                raise WhalepyError(f"the safetensors index {p / 'model.safetensors.index.json'} names "
                                   f"{missing[0].name}, which is not in {p} ({len(missing)} shard(s) missing); "
                                   "copy the whole checkpoint (every shard the index names)")
        else:
            file = p if p.is_file() else sorted(p.glob("*.safetensors"))[0]
            self.where = {k: file for k in self._handle(file).keys()}

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            try:
                from safetensors import safe_open
            except ImportError as e:
                raise WhalepyError("reading safetensors needs the safetensors package: "
                                   "pip install 'whalepy[hf]'") from e
            self._open[file] = self._stack.enter_context(safe_open(str(file), framework="pt"))
        return self._open[file]

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str, index: Sequence[slice | torch.Tensor]) -> torch.Tensor:
        part = self._handle(self.where[name]).get_slice(name)
        shape = part.get_shape()
        box, rest = [], []
        for d, ix in enumerate(index):
            if isinstance(ix, torch.Tensor):  # read the covering range, then pick
                lo = int(ix.min()) if ix.numel() else 0
                hi = int(ix.max()) + 1 if ix.numel() else 0
                box.append(slice(lo, hi))
                rest.append(ix - lo)
            else:
                box.append(slice(*ix.indices(shape[d])))
                rest.append(slice(None))
        return take(part[tuple(box)] if box else part[:], rest)

    def close(self) -> None:
        self._stack.close()


# -- the pass ----------------------------------------------------------------------------------


def _local_tensors(modules: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_parameter)`` of every tensor the modules hold, once each."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p, True))
        for name, b in m.named_buffers():
            if id(b) not in seen:
                seen.add(id(b))
                out.append((name, b, False))
    return out


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        s = _local(t).untyped_storage()
        if s.data_ptr() not in seen or s.data_ptr() == 0:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _allocate(modules: Sequence[nn.Module], device: torch.device) -> None:
    """``to_empty`` for the meta tensors only (others move to ``device``); ties are restored after,
    since ``_apply`` may give each holder of a shared DTensor parameter its own new parameter.

    A parameter FSDP2 keeps on the host (``CPUOffloadPolicy``: the ``cpu`` and ``nvme`` parameter
    tiers) is allocated on the host: FSDP2's ``reset_sharded_param`` (run by its ``_apply``) moves a
    shard to the host only when it pins it, so an unpinned one (the ``nvme`` tier's) would stay on
    the GPU, and a pinned one would pass through it first."""
    from whalepy.runtime.held import offloaded_params

    host = torch.device("cpu")
    for m in modules:
        tied: dict[int, list[str]] = {}
        for name, p in m.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(name)
        offloaded = offloaded_params([m])
        m._apply(lambda t: torch.empty_like(t, device=host if id(t) in offloaded else device) if t.is_meta
                 else t.to(device))  # noqa: B023
        for names in tied.values():
            first = m.get_parameter(names[0])
            for n in names[1:]:
                owner, _, field = n.rpartition(".")
                m.get_submodule(owner).register_parameter(field, first)


_DRY_RUN: contextvars.ContextVar[Any] = contextvars.ContextVar("whalepy_dry_run", default=None)


@contextlib.contextmanager
def dry_run(mode: Any) -> Iterator[None]:
    """Inside: :func:`materialize_modules` allocates under ``mode`` (a ``FakeTensorMode``), so a meta
    model is lowered onto tensors with shapes and devices but no memory (``whalepy check``,
    :mod:`whalepy.tools.rank_check`)."""
    token = _DRY_RUN.set(mode)
    try:
        yield
    finally:
        _DRY_RUN.reset(token)


def materialize_modules(
    modules: Sequence[nn.Module],
    skeleton: Skeleton,
    device: torch.device | str,
    *,
    seed: int = 0,
    init_fn: InitFn | None = None,
    checkpoint: str | Path | None = None,
) -> MaterializeStats:
    """Allocate and fill this rank's tensors of ``modules`` (lowered from the model ``skeleton`` was
    taken of; names are the original module paths). See the module docstring. Inside
    :func:`dry_run` the tensors are FakeTensors of that mode (no checkpoint is read)."""
    mode = _DRY_RUN.get()
    if mode is not None:  # whalepy check: every tensor a FakeTensor (shapes, no memory, no values)
        with mode:
            _allocate(modules, torch.device(device))
        share = _storage_bytes([t for _, t, is_p in _local_tensors(modules) if is_p])
        return MaterializeStats(share_bytes=share, peak_bytes=share, largest_unit_bytes=0,
                                num_tensors=len(_local_tensors(modules)))
    return _materialize_modules(modules, skeleton, device, seed=seed, init_fn=init_fn, checkpoint=checkpoint)


def _materialize_modules(modules: Sequence[nn.Module], skeleton: Skeleton, device: torch.device | str, *,
                         seed: int, init_fn: InitFn | None, checkpoint: str | Path | None) -> MaterializeStats:
    from whalepy.runtime.tiling import tile_origins

    device = torch.device(device)
    kind = checkpoint_kind(checkpoint) if checkpoint is not None else None
    # a tile of a tiled linear or embedding (runtime.tiling) comes from rows of its tensor, initialised whole
    origins = {n: o for n, o in tile_origins(modules).items() if o[0] in skeleton.meta_names}
    known = skeleton.meta_names | set(origins)
    unknown = sorted(n for n, t, _ in _local_tensors(modules) if t.is_meta and n not in known)
    if unknown:  # e.g. a constant the pipeline trace captured from a meta tensor: its value is lost
        raise WhalepyError(f"{unknown[0]} is on the meta device but is not a tensor of the model; "
                           "build the model so that forward creates no tensor from its meta state")
    _allocate(modules, device)
    targets = [(n, t, is_p) for n, t, is_p in _local_tensors(modules) if n in known]
    for n, t, _ in targets:
        if t.is_meta:
            raise WhalepyError(f"{n} is still on the meta device after materialisation")
    share = _storage_bytes([t for _, t, is_p in _local_tensors(modules) if is_p])
    reader = _Safetensors(checkpoint) if kind == "safetensors" else None
    by_unit: dict[str, list[tuple[str, torch.Tensor, bool]]] = {}
    largest = 0
    cache: dict = {}
    non_persistent = _non_persistent(skeleton)
    names_of: dict[str, list[str]] = {}
    for n, first in skeleton.canonical.items():
        names_of.setdefault(first, []).append(n)
    try:
        with torch.no_grad():
            for name, t, is_param in targets:
                source = None
                orig, first_row, rows = origins.get(name, (name, 0, None))
                if reader is not None:  # HF saves a tied weight once, under one of its names
                    source = next((n for n in [orig, *names_of[skeleton.canonical[orig]]] if n in reader),
                                  None)
                if source is not None:
                    part = reader.read(source, _shift(local_index(t, cache), first_row, rows))
                    largest = max(largest, part.nbytes)  # alive next to the share while copied
                    _fill(t, part, name)
                    del part
                elif kind == "dcp" and (is_param or name not in non_persistent):
                    continue  # DCP fills it below
                elif reader is not None and is_param:
                    raise WhalepyError(f"the safetensors checkpoint {checkpoint} has no tensor {name!r} "
                                       "(nor a tied alias of it); it is of another model")
                else:
                    owner = skeleton.canonical[orig].rpartition(".")[0]
                    by_unit.setdefault(owner, []).append((name, t, is_param))
            for owner, items in by_unit.items():
                host = init_module(skeleton, owner, seed=seed, init_fn=init_fn)
                largest = max(largest, sum(p.nbytes for p in host._parameters.values() if p is not None))
                for name, t, is_param in items:
                    orig, first_row, rows = origins.get(name, (name, 0, None))
                    attr = skeleton.canonical[orig].rpartition(".")[2]
                    if not is_param and attr in host._whalepy_unset_buffers:
                        raise WhalepyError(
                            f"the buffer {name!r} was built on the meta device and nothing initialises it "
                            f"({type(host).__name__} has no reset_parameters() or _init_weights that writes it"
                            f"{', nor does init_fn' if init_fn is not None else ''}): it would hold uninitialised "
                            "memory; fill it in reset_parameters() or init_fn, build it outside the meta device "
                            "(register it after `with torch.device('meta')`), or load it from a checkpoint")
                    value = getattr(host, attr).detach()
                    if rows is not None:
                        value = value[first_row:first_row + rows]
                    _fill(t, take(value, local_index(t, cache)), name)
                del host
    finally:
        if reader is not None:
            reader.close()
    if kind == "dcp":
        from whalepy.runtime.checkpointing import load_model_state

        load_model_state(checkpoint, modules)
    relink_original_inv_freq(modules)
    return MaterializeStats(share_bytes=share, peak_bytes=share + largest, largest_unit_bytes=largest,
                            num_tensors=len(targets))


def _shift(index: Sequence[slice | torch.Tensor], first_row: int, rows: int | None) -> tuple[slice | torch.Tensor, ...]:
    """``index`` of a tile (``rows`` rows) as an index into its module's tensor, which the tile's rows
    start at ``first_row`` of."""
    if rows is None or not index:
        return tuple(index)
    first = index[0]
    if isinstance(first, torch.Tensor):
        first = first + first_row
    else:
        lo, hi, _ = first.indices(rows)
        first = slice(first_row + lo, first_row + hi)
    return (first, *index[1:])


def _non_persistent(skeleton: Skeleton) -> set[str]:
    return {f"{mp}.{b}" if mp else b for mp, m in skeleton.root.named_modules()
            for b in getattr(m, "_non_persistent_buffers_set", ())}


def materialize(
    model: nn.Module,
    device: torch.device | str = "cpu",
    *,
    seed: int = 0,
    init_fn: InitFn | None = None,
    checkpoint: str | Path | None = None,
) -> MaterializeStats:
    """Materialise a meta-device ``model`` whole on ``device``, in one process, with exactly the values
    ``parallelize(model, ..., seed=seed, init_fn=init_fn)`` gives its shards under any plan (or read
    from ``checkpoint``: HF safetensors, or a DCP directory inside a process group)."""
    if not has_meta_tensors(model):
        raise WhalepyError("materialize() needs a model with tensors on the meta device; build it "
                           "under `with torch.device('meta'):`")
    return materialize_modules([model], snapshot(model), device, seed=seed, init_fn=init_fn,
                               checkpoint=checkpoint)
