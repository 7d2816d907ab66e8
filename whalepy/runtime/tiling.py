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
(:mod:`whalepy.runtime._tile_state`): a tiled linear's value is one tensor of the original shape, a
``TileChunks`` whose chunks are this rank's FSDP2 shards of its tiles (DCP writes several chunks per
rank from it and re-shards on load: a DTensor holds one chunk per rank, and ``ShardedTensor`` is
deprecated), or a plain tensor when the tiles are not sharded. So a checkpoint of a tiled plan loads
into an untiled one and back. A meta-device model's tiles are
initialised as the untiled linear (under the same seed) and sliced (:mod:`whalepy.runtime.materialize`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from whalepy._tiling import tile_rows
from whalepy._errors import PlanError

__all__ = ["TiledLinear", "check_tiles", "plan_tiling", "tile_model", "tile_modules", "tile_origins",
           "tile_rows", "tiled_layout"]

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
