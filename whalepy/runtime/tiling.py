"""Memory-centric tiling (``BlockPlan.tiles``; ZeRO-Infinity, Rajbhandari et al. SC'21, sec. 5.1.3).

PyTorch provides the per-unit gathering: FSDP2 all-gathers a ``fully_shard`` unit's parameters just
before its forward (and backward) and frees them after, and reduce-scatters its gradients on their
own. What it lacks is the split: whalepy replaces every module that :func:`whalepy.ir.tiling.tileable_modules`
names in a tiled block by a tiled one at the same module path, whose ``tiles`` are plain modules over
consecutive row ranges of the weight (``torch.tensor_split`` sizes: the first ``rows % tiles`` tiles
have one row more), and :mod:`whalepy.runtime.data_parallel` makes each tile its own FSDP2 unit:

- an ``nn.Linear`` becomes a :class:`TiledLinear` (rows: output features), whose forward concatenates
  the tiles' outputs on the last dim: the same values as the linear;
- an ``nn.Embedding`` becomes a :class:`TiledEmbedding` (rows: the vocabulary), whose forward looks every
  id up in each tile (the local index, clamped into the tile) and keeps a tile's row only for the ids
  in its range (``torch.where``), summed over the tiles: each id gets exactly its one row (the other
  tiles add exact zeros) and the rows an id does not select get exactly zero gradient, so values and
  gradients are the embedding's, bit for bit. A ``padding_idx`` becomes the local one of the tile
  holding it.

Names: inside the runtime a tile's parameters are ``<module>.tiles.<i>.weight`` (FSDP2 and the
optimizer see them so); every state dict and checkpoint whalepy produces uses the ORIGINAL names
(:mod:`whalepy.runtime._tile_state`): a tiled module's value is one tensor of the original shape, a
``TileChunks`` whose chunks are this rank's FSDP2 shards of its tiles (DCP writes several chunks per
rank from it and re-shards on load: a DTensor holds one chunk per rank, and ``ShardedTensor`` is
deprecated), or a plain tensor when the tiles are not sharded. So a checkpoint of a tiled plan loads
into an untiled one and back. A meta-device model's tiles are
initialised as the untiled module (under the same seed) and sliced (:mod:`whalepy.runtime.materialize`).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from whalepy.ir.tiling import tile_rows
from whalepy.errors import PlanError

__all__ = ["TiledEmbedding", "TiledLinear", "check_tiles", "plan_tiling", "tile_model", "tile_modules",
           "tile_origins", "tile_rows", "tiled_layout"]

_PARAMS = ("weight", "bias")


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


class TiledEmbedding(nn.Module):
    """An ``nn.Embedding`` split along its rows into ``tiles`` (each an ``nn.Embedding`` of consecutive
    rows); ``forward`` gives every id its one row (module docstring), the embedding's own output."""

    def __init__(self, tiles: Sequence[nn.Embedding], padding_idx: int | None = None) -> None:
        super().__init__()
        self.tiles = nn.ModuleList(tiles)
        self.num_embeddings = sum(t.num_embeddings for t in tiles)
        self.embedding_dim = tiles[0].embedding_dim
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, start = None, 0
        for t in self.tiles:
            local = ids - start
            inside = ((local >= 0) & (local < t.num_embeddings)).unsqueeze(-1)
            part = torch.where(inside, t(local.clamp(0, t.num_embeddings - 1)), 0)
            out = part if out is None else out + part
            start += t.num_embeddings
        return out

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}, tiles={len(self.tiles)}"


_TILED = (TiledLinear, TiledEmbedding)


def _rows(tile: nn.Module) -> int:
    return tile.out_features if isinstance(tile, nn.Linear) else tile.num_embeddings


def _split_embedding(emb: nn.Embedding, tiles: int) -> TiledEmbedding:
    parts, start = [], 0
    for w in torch.split(emb.weight.detach(), tile_rows(emb.num_embeddings, tiles)):
        n = w.shape[0]
        inside = emb.padding_idx is not None and start <= emb.padding_idx < start + n
        pad = emb.padding_idx - start if inside else None
        t = nn.Embedding(n, emb.embedding_dim, padding_idx=pad, device="meta", dtype=w.dtype)
        t.weight = nn.Parameter(w.clone(), requires_grad=emb.weight.requires_grad)
        parts.append(t)
        start += n
    out = TiledEmbedding(parts, emb.padding_idx)
    out.train(emb.training)
    return out


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


def check_tiles(plan: Any, shared: Collection[str] = ()) -> None:
    """:class:`PlanError` for a block whose ``tiles`` the runtime does not lower
    (:func:`whalepy.ir.rules.tiling_error`), before any lowering; ``shared``: the blocks that
    share a parameter with another block (a tied weight)."""
    from whalepy.ir.rules import tiling_error

    for st in plan.stages:
        for b in st.blocks:
            reason = tiling_error(b.tiles, zero=st.zero_stage, tp=st.tp_degree, shares_params=b.name in shared)
            if reason is not None:
                raise PlanError(f"block {b.name!r}: {reason}")


def plan_tiling(model: nn.Module, plan: Any, block_modules: dict[str, Sequence[str]]) -> dict[str, dict[str, int]]:
    """Block name -> {module path: tiles} for every tiled block of ``plan`` (checked with
    :func:`check_tiles`): :func:`whalepy.ir.tiling.tileable_modules` of the whole model, before any
    pipeline split (so a tie across stages is seen), exactly what the profile sized. A module with
    fewer rows than the block's ``tiles`` gets one tile per row (a tile is at least a row: the
    planner's ``ceil(rows / tiles)`` rows per tile is one then too)."""
    from whalepy.ir.tiling import tileable_modules
    from whalepy.passes.profile import shares_params

    shared = {b.name for st in plan.stages for b in st.blocks
              if b.tiles > 1 and shares_params(model, tuple(block_modules[b.name]))}
    check_tiles(plan, shared)
    return {b.name: {n: min(b.tiles, _rows(m)) for n, m in tileable_modules(model, block_modules[b.name])}
            for st in plan.stages for b in st.blocks if b.tiles > 1}


def tile_model(root: nn.Module, tiling: dict[str, int]) -> int:
    """Replace each module ``path`` of ``tiling`` in ``root`` (the model or a pipeline stage holding the
    block) by its tiled module of ``tiling[path]`` tiles (values copied; meta stays meta). Returns the
    modules tiled."""
    if tiling:
        # a tile's output is a view (F.linear of a 3-D input) only ever read by TiledLinear's torch.cat,
        # never modified in place: FSDP2's warning about in-place ops on it does not apply
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPLinear\) returned a view tensor")
    n = 0
    for path, tiles in tiling.items():
        m = root.get_submodule(path)
        if isinstance(m, _TILED):
            continue  # already tiled
        parent, _, field = path.rpartition(".")
        split = _split_embedding(m, tiles) if isinstance(m, nn.Embedding) else _split_linear(m, tiles)
        setattr(root.get_submodule(parent) if parent else root, field, split)
        n += 1
    return n


def tile_modules(module: nn.Module) -> list[nn.Module]:
    """The tiles of every tiled module inside ``module`` (itself included), in module order."""
    return [t for m in module.modules() if isinstance(m, _TILED) for t in m.tiles]


def tiled_layout(modules: Iterable[nn.Module]) -> dict[str, list[int]]:
    """Original module path -> rows of each tile, for every tiled module in ``modules`` (the lowered
    model or its pipeline stages, whose names are the original ones)."""
    return {name: [_rows(t) for t in m.tiles] for root in modules
            for name, m in root.named_modules() if isinstance(m, _TILED)}


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
