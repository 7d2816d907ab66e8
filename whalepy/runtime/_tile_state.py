"""State dicts of tiled modules under their ORIGINAL names (:mod:`whalepy.runtime.tiling`).

Inside the runtime a tile's parameters are ``<module>.tiles.<i>.weight``; :func:`merge_state` joins a
tiled module's tile entries (model and optimizer) into one entry of the module's name and shape, and
:func:`split_state` splits such an entry back into this plan's tiles. A merged value is a
:class:`TileChunks` when the tiles are FSDP2-sharded (this rank's shards, no copy; DCP reads and writes
it as several chunks of one tensor), a plain tensor (``torch.cat`` of the tiles) otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from whalepy.errors import WhalepyError
from whalepy.runtime.host_optimizer import as_shard_of, full_tensor

__all__ = ["TileChunks", "merge_state", "split_state"]

_PARAMS = ("weight", "bias")


class TileChunks(torch.Tensor):
    """A tiled module's tensor (its original shape) as this rank's chunks of it: one per tile, each the
    tile's FSDP2 local shard itself (no copy). It carries no data of its own and supports no tensor
    operations; it implements DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``, as ``DTensor`` does), so ``dcp.save`` writes the
    chunks and ``dcp.load`` fills them in place, re-sharding from whatever layout wrote the files."""

    chunks: list[tuple[int, torch.Tensor]]
    """``(first row in the whole tensor, local tensor)`` per tile with rows on this rank."""

    @staticmethod
    def __new__(cls, chunks: list[tuple[int, torch.Tensor]], size: torch.Size, like: torch.Tensor) -> TileChunks:
        t = torch.Tensor._make_wrapper_subclass(cls, size, dtype=like.dtype, device=like.device,
                                                requires_grad=False)
        t.chunks = chunks
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise WhalepyError(f"{func} on a tiled module's state-dict value: it only describes this rank's tile "
                           "shards for torch.distributed.checkpoint; use pm.full_state_dict() for tensors")

    def _offsets(self, row: int) -> torch.Size:
        return torch.Size([row] + [0] * (len(self.shape) - 1))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, self._offsets(row)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=self._offsets(row), sizes=local.size()),
                              properties=TensorProperties.create_from_tensor(local), size=self.size()))
                for row, local in self.chunks]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=self._offsets(row), sizes=local.size()) for row, local in self.chunks]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for row, local in self.chunks:
            if index.offset is None or index.offset[0] == row:
                return local
        raise WhalepyError(f"{index.fqn}: no tile chunk of this rank starts at row {index.offset[0]}")


def _chunks(values: Sequence[Any], rows: Sequence[int]) -> TileChunks:
    """The :class:`TileChunks` of a tiled module from its tiles' FSDP2 DTensors (``Shard(0)`` on one mesh dim)."""
    from torch.distributed.tensor import Shard

    first = values[0]
    if first.device_mesh.ndim != 1 or any(v.placements != (Shard(0),) for v in values):
        raise WhalepyError(f"a tiled module's tiles are laid out as {first.placements} over a "
                           f"{first.device_mesh.ndim}-D mesh; tiling lowers only Shard(0) over the "
                           "data-parallel mesh: use tiles=1")
    chunks, start = [], 0
    for v, n in zip(values, rows, strict=True):
        local = v._local_tensor
        if local.shape[0]:
            chunks.append((start + _first_row(v), local))
        start += n
    return TileChunks(chunks, torch.Size([start, *first.shape[1:]]), first._local_tensor)


def _merge(values: Sequence[Any], rows: Sequence[int]) -> Any:
    from torch.distributed.tensor import DTensor

    if not isinstance(values[0], torch.Tensor) or values[0].dim() == 0:
        return values[0]  # a scalar state (AdamW's step): the same for every tile
    if all(isinstance(v, DTensor) for v in values):
        return _chunks(values, rows)
    return torch.cat([full_tensor(v) for v in values])


def _split(value: Any, templates: Sequence[Any], rows: Sequence[int]) -> list[Any]:
    """Per-tile values shaped (and sharded) like ``templates`` from a value under the original name."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return [value.clone() if isinstance(value, torch.Tensor) else value for _ in templates]
    if isinstance(value, TileChunks):  # one of this plan's own (load_train_state's template)
        by_row = dict(value.chunks)
        out, start = [], 0
        for like, n in zip(templates, rows, strict=True):
            local = like._local_tensor
            got = by_row.get(start + _first_row(like)) if local.shape[0] else local
            if got is None or got.shape != local.shape:
                raise WhalepyError("a tiled module's state is split unlike this plan's tiles; load it "
                                   "through ParallelModel.load / load_state_dict of the plan that made it")
            out.append(as_shard_of(like, got))  # not from_local: a host chunk stays on the host
            start += n
        return out
    full = full_tensor(value)
    parts = torch.split(full, list(rows))
    return [distribute_tensor(p.to(like._local_tensor.device), like.device_mesh, like.placements,
                              src_data_rank=None) if isinstance(like, DTensor) else p
            for p, like in zip(parts, templates, strict=True)]


def _first_row(like: Any) -> int:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return int(compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)[1][0])


_TILE_KEY = re.compile(r"^(.*)\.tiles\.(\d+)\.(weight|bias)$")


def _entries(layout: dict[str, list[int]]) -> Iterator[tuple[str, list[str], list[int]]]:
    """``(original name, its tiles' names, rows per tile)`` of every tiled module's weight and bias."""
    for prefix, rows in layout.items():
        for p in _PARAMS:
            yield f"{prefix}.{p}", [f"{prefix}.tiles.{i}.{p}" for i in range(len(rows))], rows


def merge_state(state: dict[str, Any], layout: dict[str, list[int]]) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (or a flat model state dict) with each tiled module's tile
    entries replaced by one entry under the original name (module docstring); entries of tiles that
    ``state`` lacks (other ranks' part of a full state dict) are left as they are."""
    if not layout:
        return state
    if "model" not in state and "optim" not in state:
        return _merge_flat(state, layout)
    out = dict(state)
    if "model" in state:
        out["model"] = _merge_flat(state["model"], layout)
    optim = state.get("optim")
    if isinstance(optim, dict) and "state" in optim:
        per = dict(optim["state"])
        for name, keys, rows in _entries(layout):
            if all(k in per for k in keys):
                tiles = [per.pop(k) for k in keys]
                per[name] = {s: _merge([t[s] for t in tiles], rows) for s in tiles[0]}
        groups = [{**g, "params": _rename(g["params"], layout)} for g in optim.get("param_groups", [])]
        out["optim"] = {**optim, "state": per, "param_groups": groups}
    return out


def _merge_flat(sd: dict[str, Any], layout: dict[str, list[int]]) -> dict[str, Any]:
    out = dict(sd)
    for name, keys, rows in _entries(layout):
        if all(k in out for k in keys):
            out[name] = _merge([out.pop(k) for k in keys], rows)
    return out


def _rename(names: Sequence[str], layout: dict[str, list[int]]) -> list[str]:
    out: list[str] = []
    for n in names:
        m = _TILE_KEY.match(n)
        if m is not None and m.group(1) in layout:
            n = f"{m.group(1)}.{m.group(3)}"
        if n not in out:
            out.append(n)
    return out


def split_state(state: dict[str, Any], template: dict[str, Any], layout: dict[str, list[int]]) -> dict[str, Any]:
    """The inverse of :func:`merge_state`: entries under the original names of tiled modules become
    their tiles' entries, shaped and sharded like ``template`` (this plan's unmerged state dict)."""
    if not layout:
        return state
    if "model" not in state and "optim" not in state:
        return _split_flat(state, template, layout)
    out = dict(state)
    if "model" in state:
        out["model"] = _split_flat(state["model"], template.get("model", {}), layout)
    optim = state.get("optim")
    if isinstance(optim, dict) and "state" in optim:
        like = template.get("optim", {}).get("state", {})
        per = dict(optim["state"])
        for name, keys, rows in _entries(layout):
            if name in per and all(k in like for k in keys):
                merged = per.pop(name)
                parts = {s: _split(v, [like[k].get(s) for k in keys], rows) for s, v in merged.items()}
                for i, k in enumerate(keys):
                    per[k] = {s: vs[i] for s, vs in parts.items()}
        groups = [{**g, "params": _expand(g["params"], layout)} for g in optim.get("param_groups", [])]
        out["optim"] = {**optim, "state": per, "param_groups": groups}
    return out


def _split_flat(sd: dict[str, Any], template: dict[str, Any], layout: dict[str, list[int]]) -> dict[str, Any]:
    out = dict(sd)
    for name, keys, rows in _entries(layout):
        if name in out and all(k in template for k in keys):
            out.update(zip(keys, _split(out.pop(name), [template[k] for k in keys], rows), strict=True))
    return out


def _expand(names: Sequence[str], layout: dict[str, list[int]]) -> list[str]:
    out: list[str] = []
    for n in names:
        prefix, _, p = n.rpartition(".")
        if prefix in layout and p in _PARAMS:
            out += [f"{prefix}.tiles.{i}.{p}" for i in range(len(layout[prefix]))]
        else:
            out.append(n)
    return out
