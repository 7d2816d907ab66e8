"""Which modules memory-centric tiling splits (``BlockPlan.tiles``), in one place: the profile counts
their parameters (``BlockProfile.linear_params`` / ``largest_linear_params`` / ``linear_rows``) and the
runtime (:mod:`whalepy.runtime.tiling`) splits exactly these, so the planner's working set is the
runtime's.

Memory-centric tiling is ZeRO-Infinity's (Rajbhandari et al., SC'21, sec. 5.1.3): a large operator is
split into tiles run one after another; with ZeRO-3 each tile's parameters are gathered, and its
gradients reduced, on their own, so the working set is one tile rather than the whole operator. whalepy
splits each ``nn.Linear`` along its output features and each ``nn.Embedding`` along its rows (the
vocabulary), both into ``torch.tensor_split`` sizes (the first ``rows % tiles`` tiles have one row more);
either way a tile is ``rows / tiles`` rows of the weight, so the planner sizes both alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["largest_tile_params", "linear_param_counts", "linear_rows", "tile_rows", "tileable_modules"]


def _tileable(m: Any) -> bool:
    """An ``nn.Linear``, or an ``nn.Embedding`` whose lookup a row split keeps exact (no ``max_norm``
    renormalisation, no ``scale_grad_by_freq`` or ``sparse`` gradient: those depend on the whole table
    or lower to sparse gradients FSDP2 does not reduce; such an embedding stays whole, in its block's own
    unit, and the profile counts it there)."""
    from torch import nn

    if isinstance(m, nn.Linear):
        return True
    return (isinstance(m, nn.Embedding) and m.max_norm is None and not m.scale_grad_by_freq
            and not m.sparse)


def parameter_users(model: Any) -> dict[int, int]:
    """How many modules of ``model`` use each parameter (``id`` -> count): one walk of the model, which
    the callers of :func:`tileable_modules` for every block of a model make once and pass in."""
    users: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    return users


def tileable_modules(model: Any, paths: Iterable[str], users: dict[int, int] | None = None) -> list[tuple[str, Any]]:
    """``(qualified name, module)`` of every tileable ``torch.nn.Linear`` and ``torch.nn.Embedding``
    under the module paths ``paths`` of ``model``, in module order, each once; a module whose weight
    another module also uses (tied, e.g. a language-model head sharing the embedding) is left out:
    splitting it would untie it (a block that shares a parameter with another block is not tiled at
    all: :func:`whalepy.ir.rules.tiling_error`). ``users``: :func:`parameter_users` of ``model``,
    where the caller has it (else it is computed here: a walk of the whole model)."""
    if users is None:
        users = parameter_users(model)
    out: dict[int, tuple[str, Any]] = {}
    for path in paths:
        root = model.get_submodule(path) if path else model
        for name, m in root.named_modules(prefix=path):
            if _tileable(m) and id(m) not in out and users.get(id(m.weight), 0) == 1:
                out[id(m)] = (name, m)
    return list(out.values())


def linear_param_counts(rows: Iterable[tuple[int, int]]) -> tuple[int, int, int]:
    """``(sum, largest, count)`` of the tileable modules' parameter counts, from their
    :func:`linear_rows`."""
    sizes = [out * per_row for out, per_row in rows]
    return sum(sizes), max(sizes, default=0), len(sizes)


def linear_rows(model: Any, paths: Iterable[str], users: dict[int, int] | None = None) -> tuple[tuple[int, int], ...]:
    """``(rows, parameters per row)`` of each of :func:`tileable_modules`: a linear's output features and
    its input features plus its bias; an embedding's rows (``num_embeddings``) and ``embedding_dim``."""
    from torch import nn

    out = []
    for _, m in tileable_modules(model, paths, users):
        if isinstance(m, nn.Embedding):
            out.append((m.num_embeddings, m.embedding_dim))
        else:
            out.append((m.out_features, m.in_features + (1 if m.bias is not None else 0)))
    return tuple(out)


def tile_rows(out_features: int, tiles: int) -> list[int]:
    """Rows of each tile (``torch.tensor_split`` sizes: the first ``out % tiles`` one row more)."""
    return [out_features // tiles + (1 if i < out_features % tiles else 0) for i in range(tiles)]


def largest_tile_params(rows: Iterable[tuple[int, int]], tiles: int) -> int:
    """Parameters of the largest tile over modules of ``(rows, parameters per row)`` split into ``tiles``
    (0 for none)."""
    return max((-(-out // tiles) * per_row for out, per_row in rows), default=0)
