"""Memory-centric tiling (``BlockPlan.tiles``; ZeRO-Infinity, Rajbhandari et al. SC'21, sec. 5.1.3).

PyTorch provides the per-unit gathering: FSDP2 all-gathers a ``fully_shard`` unit's parameters just
before its forward (and backward) and frees them after, and reduce-scatters its gradients on their
own. What it lacks is the split: whalepy replaces every linear that :func:`whalepy._tiling.tileable_linears`
names in a tiled block by a :class:`TiledLinear` at the same module path, whose ``tiles`` are plain
``nn.Linear`` s over consecutive row ranges of the weight (``torch.tensor_split`` sizes: the first
``out % tiles`` tiles have one row more), and :mod:`whalepy.runtime.data_parallel` makes each tile its
own FSDP2 unit. The forward concatenates the tiles' outputs on the last dim: the same values as the
linear.

Names: inside the runtime a tile's parameters are ``<linear>.tiles.<i>.weight`` (FSDP2 and the
optimizer see them so); every state dict and checkpoint whalepy produces uses the ORIGINAL names
(:func:`merge_state`, :func:`split_state`): a tiled linear's value is one tensor of the original shape,
a :class:`TileChunks` whose chunks are this rank's FSDP2 shards of its tiles (DCP writes several
chunks per rank from it and re-shards on load: DTensor holds one chunk per rank, and ShardedTensor is
deprecated), or a plain tensor when the tiles are not sharded. So a
checkpoint of a tiled plan loads into an untiled one and back. A meta-device model's tiles are
initialised as the untiled linear (under the same seed) and sliced (:mod:`whalepy.runtime.materialize`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from whalepy._errors import PlanError, WhalepyError

__all__ = ["TileChunks", "TiledLinear", "check_tiles", "merge_state", "plan_tiling", "split_state", "tile_model", "tile_modules", "tile_origins",
           "tile_rows", "tiled_layout"]

_PARAMS = ("weight", "bias")


def tile_rows(out_features: int, tiles: int) -> list[int]:
    """Rows of each tile (``torch.tensor_split`` sizes: the first ``out % tiles`` one row more)."""
    return [out_features // tiles + (1 if i < out_features % tiles else 0) for i in range(tiles)]


class TiledLinear(nn.Module):
    """An ``nn.Linear`` split along its output features into ``tiles`` (each an ``nn.Linear``);
    ``forward`` is the concatenation of the tiles' outputs, the linear's own output."""

    def __init__(self, tiles: Sequence[nn.Linear]) -> None:
        super().__init__()
        self.tiles = nn.ModuleList(tiles)
        self.in_features = tiles[0].in_features
        self.out_features = sum(t.out_features for t in tiles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(x) for t in self.tiles], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles={len(self.tiles)}"


def _split_linear(lin: nn.Linear, tiles: int) -> TiledLinear:
    sizes = tile_rows(lin.out_features, tiles)
    ws = torch.split(lin.weight.detach(), sizes)
    bs = torch.split(lin.bias.detach(), sizes) if lin.bias is not None else [None] * tiles
    parts = []
    for w, b in zip(ws, bs, strict=True):
        t = nn.Linear(lin.in_features, w.shape[0], bias=b is not None, device="meta", dtype=w.dtype)
        t.weight = nn.Parameter(w.clone(), requires_grad=lin.weight.requires_grad)
        if b is not None:
            t.bias = nn.Parameter(b.clone(), requires_grad=lin.bias.requires_grad)  # type: ignore[union-attr]
        parts.append(t)
    out = TiledLinear(parts)
    out.train(lin.training)
    return out


def check_tiles(plan: Any, linears: dict[str, list[tuple[str, int]]]) -> None:
    """:class:`PlanError` for a block whose ``tiles`` the runtime does not lower
    (:func:`whalepy._capabilities.tiling_error`) or that exceed a linear's output features; before any
    lowering. ``linears``: block name -> ``(linear path, out_features)`` of its tileable linears."""
    from whalepy._capabilities import tiling_error

    for st in plan.stages:
        for b in st.blocks:
            reason = tiling_error(b.tiles, zero=st.zero_stage, tp=st.tp_degree)
            if reason is not None:
                raise PlanError(f"block {b.name!r}: {reason}")
            for path, out in linears.get(b.name, []):
                if b.tiles > out:
                    raise PlanError(f"block {b.name!r}: tiles={b.tiles} exceeds the {out} output features of "
                                    f"{path}; use tiles <= {out}")


def plan_tiling(model: nn.Module, plan: Any, block_modules: dict[str, Sequence[str]]) -> dict[str, dict[str, int]]:
    """Block name -> {linear path: tiles} for every tiled block of ``plan`` (checked with
    :func:`check_tiles`): :func:`whalepy._tiling.tileable_linears` of the whole model, before any
    pipeline split (so a tie across stages is seen), exactly what the profile sized."""
    from whalepy._tiling import tileable_linears

    linears: dict[str, list[tuple[str, int]]] = {}
    out: dict[str, dict[str, int]] = {}
    for st in plan.stages:
        for b in st.blocks:
            if b.tiles > 1:
                found = tileable_linears(model, block_modules[b.name])
                linears[b.name] = [(n, m.out_features) for n, m in found]
                out[b.name] = {n: b.tiles for n, _ in found}
    check_tiles(plan, linears)
    return out


def tile_model(root: nn.Module, tiling: dict[str, int]) -> int:
    """Replace each linear ``path`` of ``tiling`` in ``root`` (the model or a pipeline stage holding the
    block) by a :class:`TiledLinear` of ``tiling[path]`` tiles (values copied; meta stays meta). Returns
    the linears tiled."""
    if tiling:
        # a tile's output is a view (F.linear of a 3-D input) only ever read by TiledLinear's torch.cat,
        # never modified in place: FSDP2's warning about in-place ops on it does not apply
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPLinear\) returned a view tensor")
    n = 0
    for path, tiles in tiling.items():
        lin = root.get_submodule(path)
        if not isinstance(lin, nn.Linear):
            continue  # already tiled
        parent, _, field = path.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, field, _split_linear(lin, tiles))
        n += 1
    return n


def tile_modules(module: nn.Module) -> list[nn.Linear]:
    """The tiles of every :class:`TiledLinear` inside ``module`` (itself included), in module order."""
    return [t for m in module.modules() if isinstance(m, TiledLinear) for t in m.tiles]


def tiled_layout(modules: Iterable[nn.Module]) -> dict[str, list[int]]:
    """Original linear path -> rows of each tile, for every :class:`TiledLinear` in ``modules`` (the
    lowered model or its pipeline stages, whose names are the original ones)."""
    return {name: [t.out_features for t in m.tiles] for root in modules
            for name, m in root.named_modules() if isinstance(m, TiledLinear)}


def tile_origins(modules: Iterable[nn.Module]) -> dict[str, tuple[str, int, int]]:
    """Tile tensor name -> ``(original name, first row, rows)``."""
    out = {}
    for prefix, rows in tiled_layout(modules).items():
        start = 0
        for i, n in enumerate(rows):
            for p in _PARAMS:
                out[f"{prefix}.tiles.{i}.{p}"] = (f"{prefix}.{p}", start, n)
            start += n
    return out


# -- state dicts under the original names ---------------------------------------------------------


class TileChunks(torch.Tensor):
    """A tiled linear's tensor (its original shape) as this rank's chunks of it: one per tile, each the
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
        raise WhalepyError(f"{func} on a tiled linear's state-dict value: it only describes this rank's tile "
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
    """The :class:`TileChunks` of a linear from its tiles' FSDP2 DTensors (``Shard(0)`` on one mesh dim)."""
    from torch.distributed.tensor import Shard

    first = values[0]
    if first.device_mesh.ndim != 1 or any(v.placements != (Shard(0),) for v in values):
        raise WhalepyError(f"a tiled linear's tiles are laid out as {first.placements} over a "
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
    return torch.cat([v.full_tensor() if isinstance(v, DTensor) else v for v in values])


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
                raise WhalepyError("a tiled linear's state is split unlike this plan's tiles; load it "
                                   "through ParallelModel.load / load_state_dict of the plan that made it")
            out.append(DTensor.from_local(got, like.device_mesh, like.placements, run_check=False,
                                          shape=like.shape, stride=like.stride()))
            start += n
        return out
    full = value.full_tensor() if isinstance(value, DTensor) else value
    parts = torch.split(full, list(rows))
    return [distribute_tensor(p.to(like._local_tensor.device), like.device_mesh, like.placements,
                              src_data_rank=None) if isinstance(like, DTensor) else p
            for p, like in zip(parts, templates, strict=True)]


def _first_row(like: Any) -> int:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return int(compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)[1][0])


_TILE_KEY = re.compile(r"^(.*)\.tiles\.(\d+)\.(weight|bias)$")


def merge_state(state: dict[str, Any], layout: dict[str, list[int]]) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (or a flat model state dict) with each tiled linear's tile
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
        for prefix, rows in layout.items():
            for p in _PARAMS:
                keys = [f"{prefix}.tiles.{i}.{p}" for i in range(len(rows))]
                if not all(k in per for k in keys):
                    continue
                tiles = [per.pop(k) for k in keys]
                per[f"{prefix}.{p}"] = {s: _merge([t[s] for t in tiles], rows) for s in tiles[0]}
        groups = [{**g, "params": _rename(g["params"], layout)} for g in optim.get("param_groups", [])]
        out["optim"] = {**optim, "state": per, "param_groups": groups}
    return out


def _merge_flat(sd: dict[str, Any], layout: dict[str, list[int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    done: set[str] = set()
    for key, value in sd.items():
        m = _TILE_KEY.match(key)
        if m is None or m.group(1) not in layout:
            out[key] = value
            continue
        prefix, p = m.group(1), m.group(3)
        rows = layout[prefix]
        keys = [f"{prefix}.tiles.{i}.{p}" for i in range(len(rows))]
        if f"{prefix}.{p}" in done:
            continue
        if not all(k in sd for k in keys):
            out[key] = value
            continue
        done.add(f"{prefix}.{p}")
        out[f"{prefix}.{p}"] = _merge([sd[k] for k in keys], rows)
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
    """The inverse of :func:`merge_state`: entries under the original names of tiled linears become
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
        for prefix, rows in layout.items():
            for p in _PARAMS:
                name = f"{prefix}.{p}"
                keys = [f"{prefix}.tiles.{i}.{p}" for i in range(len(rows))]
                if name not in per or not all(k in like for k in keys):
                    continue
                merged = per.pop(name)
                parts = {s: _split(v, [like[k].get(s) for k in keys], rows) for s, v in merged.items()}
                for i, k in enumerate(keys):
                    per[k] = {s: vs[i] for s, vs in parts.items()}
        groups = [{**g, "params": _expand(g["params"], layout)} for g in optim.get("param_groups", [])]
        out["optim"] = {**optim, "state": per, "param_groups": groups}
    return out


def _split_flat(sd: dict[str, Any], template: dict[str, Any], layout: dict[str, list[int]]) -> dict[str, Any]:
    out = dict(sd)
    for prefix, rows in layout.items():
        for p in _PARAMS:
            name = f"{prefix}.{p}"
            keys = [f"{prefix}.tiles.{i}.{p}" for i in range(len(rows))]
            if name not in out or not all(k in template for k in keys):
                continue
            for k, v in zip(keys, _split(out.pop(name), [template[k] for k in keys], rows), strict=True):
                out[k] = v
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
