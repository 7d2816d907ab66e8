"""Memory-centric tiling in the planner (``BlockPlan.tiles``, :mod:`whalepy.ir.tiling`): the FSDP2 unit a
tiled block's working set is sized by, the tiled state options a candidate is offered, and the time a
tiled block adds.

Tiling buys working memory with collectives: a block whose linears and embeddings (the profile's
``linear_rows``, :func:`whalepy.ir.tiling.tileable_modules`) are split into ``t`` tiles each gathers and
reduce-scatters ``num_linears * t`` units instead of one block. Its bytes are the same; what grows is
the number of collectives, each with its latency (``cost_models.communication``, measured / cited per
fabric). The compute is the same GEMMs cut along their output features; the smaller GEMMs' efficiency
loss is not charged (the tiles the planner offers are large: see ``TILED_WORKING_SHARE``); a tiled
embedding's extra lookups and masks (memory-bound, one pass over the output per tile) are not charged
either: the block's own time is not costed from its linears' shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from whalepy.ir.rules import tiling_error
from whalepy.ir.tiling import largest_tile_params
from whalepy.cost_models.communication import Collective
from whalepy.ir.plan import ZeroStage
from whalepy.planner.space import StateOption
from whalepy.ir.profile import BlockProfile

__all__ = ["MAX_TILES", "TILED_WORKING_SHARE", "block_tiles", "tiled_options", "tiling_latency_s", "unit_params"]

TILED_WORKING_SHARE = 0.25
"""NAMED CONSTANT (search space, not a cost): a tiled variant of a ZeRO-3 option is offered only when
the untiled FSDP2 working set is more than this share of the device's usable memory, with the fewest
tiles (a power of two) that bring it under. Below that share tiling cannot make a plan fit that does not
fit untiled by a wide margin, and each tile only adds collectives; offering every tile count would
multiply the ILP's options for nothing. A quarter leaves three quarters of the device to model states
and activations, which is where ZeRO-Infinity's 1T-on-one-DGX-2 case sits (sec. 5.1.3)."""

MAX_TILES = 64
"""Most tiles offered per linear: 64 tiles of the largest published case's MLP linear (hidden 64K,
ZeRO-Infinity's 32T model on 512 GPUs) are 268M parameters, 0.5 GB in 16 bits."""


def block_tiles(block: BlockProfile, tiles: int) -> int:
    """The tiles ``block`` gets under a stage option of ``tiles``: ``tiles`` where it has modules to
    tile and the runtime tiles it (:func:`tiling_error` of a block that shares a parameter: a tied
    embedding or head), else 1."""
    if tiles == 1 or not block.largest_linear_params:
        return 1
    return 1 if tiling_error(tiles, zero=ZeroStage.PARAMETERS, tp=1, shares_params=block.shares_params) else tiles


def unit_params(block: BlockProfile, tiles: int) -> float:
    """Parameters of the largest FSDP2 unit of ``block`` (tp 1) with ``tiles`` tiles: the block itself
    untiled (or not tiled: :func:`block_tiles`); tiled, the largest tile (each linear's or embedding's
    ``ceil(rows / tiles)`` rows, :func:`whalepy.ir.tiling.largest_tile_params`; ``largest / tiles`` where
    the profile has no shapes) or what the block's own unit keeps (its parameters outside the tiled
    modules), whichever is larger."""
    if block_tiles(block, tiles) == 1:
        return float(block.num_params)
    tile = (largest_tile_params(block.linear_rows, tiles) if block.linear_rows
            else block.largest_linear_params / tiles)
    return max(float(tile), float(block.num_params - block.linear_params))


def tiled_options(options: Sequence[StateOption], blocks: Sequence[BlockProfile], *, tp: int,
                  working_bytes, capacity_bytes: float) -> tuple[StateOption, ...]:  # type: ignore[no-untyped-def]
    """``options`` plus, for each untiled ZeRO-3 option the runtime can tile (:func:`tiling_error`), the
    variant with the fewest tiles (power of two, at most ``MAX_TILES``) whose tiled blocks' FSDP2
    working set (``working_bytes(unit_params)``, bytes) is at most ``TILED_WORKING_SHARE`` of
    ``capacity_bytes`` (or whose tiles are no larger than the largest unit tiling leaves whole), when
    the untiled one is above it."""
    tileable = [b for b in blocks if block_tiles(b, 2) > 1]
    if not tileable or capacity_bytes <= 0:
        return tuple(options)
    budget = TILED_WORKING_SHARE * capacity_bytes
    # the units tiling leaves whole (a tied block, a block's own parameters) stay as large as they are:
    # tiling further than down to them gains nothing
    tiled = {id(b) for b in tileable}
    floor = max([float(b.num_params) for b in blocks if id(b) not in tiled]
                + [float(b.num_params - b.linear_params) for b in tileable], default=0.0)
    out = list(options)
    for o in options:
        if o.tiles != 1 or o.zero is not ZeroStage.PARAMETERS or tiling_error(2, zero=o.zero, tp=tp):
            continue
        if working_bytes(max(unit_params(b, 1) for b in tileable)) <= budget:
            continue
        t = 2
        while (t < MAX_TILES and working_bytes(max(unit_params(b, t) for b in tileable)) > budget
               and max(unit_params(b, t) for b in tileable) > floor):
            t *= 2
        variant = dataclasses.replace(o, tiles=t)
        if variant not in out:
            out.append(variant)
    return tuple(out)


def tiling_latency_s(collective, block: BlockProfile, tiles: int, group) -> float:  # type: ignore[no-untyped-def]
    """Seconds per micro-batch tiling adds to one block: each of the ``num_linears * (tiles - 1)`` extra
    units gathers in forward and in backward and reduce-scatters in backward, each collective paying
    its latency (a one-byte collective on ``group``, the stage's data-parallel communicator). Charged
    exposed: an upper bound, tens of microseconds per unit."""
    if block_tiles(block, tiles) == 1 or group is None:
        return 0.0
    lat = 2 * collective(Collective.ALL_GATHER, 1.0, group) + collective(Collective.REDUCE_SCATTER, 1.0, group)
    return block.num_linears * (tiles - 1) * lat
