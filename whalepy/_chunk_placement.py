"""Chunked parameter placement driven by a warm-up trace (PatrickStar, Fang et al., TPDS'23), against
static per-block placement: how many parameter bytes must cross the host link per iteration when the
device holds only part of the model.

Both replay the same access sequence: every module's parameters are used in forward order, then in
reverse order in backward (:func:`access_sequence`, from a :class:`~whalepy.MemoryTrace`). The room for
parameters at each access is the device budget less the activations alive then (the trace's saved
bytes, which rise through the forward and fall through the backward).

- :func:`static_block_traffic`: a fixed set of blocks stays on the device for the whole iteration (the
  largest set that fits next to the activation peak, blocks taken in order of use); every other block is
  fetched at each of its uses (whalepy's per-stage tiers, the ZeRO-Infinity way).
- :func:`chunk_traffic`: parameters packed into fixed-size chunks in order of first use; a chunk is
  fetched when used and not resident; when the room is exceeded, the resident chunk used furthest in the
  future is evicted (Belady's rule, which the trace makes possible: PatrickStar's eviction policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Access", "access_sequence", "block_module_accesses", "chunk_traffic", "static_block_traffic"]


@dataclass(frozen=True, slots=True)
class Access:
    unit: str
    """Module (or block) whose parameters are used."""
    activation_bytes: int
    """Activation bytes alive at this point of the iteration."""


def access_sequence(trace, units: Sequence[str]) -> list[Access]:  # type: ignore[no-untyped-def]
    """Forward then backward uses of ``units`` (module paths, in the order the trace first runs them),
    each with the activation bytes alive then: in forward the trace's saved bytes when the unit starts;
    in backward those of the units up to and including it (the later units' have been freed, its own
    are freed by its backward)."""
    level: dict[str, int] = {}
    for e in trace.events:
        if e.phase != "forward":
            break
        for u in units:
            if u not in level and (e.module == u or e.module.startswith(u + ".")):
                level[u] = e.saved_bytes
    order = sorted(level, key=lambda u: level[u])
    peak = trace.peak_saved_bytes
    forward = [Access(u, level[u]) for u in order]
    after = [level[u] for u in order[1:]] + [peak]
    backward = [Access(u, a) for u, a in reversed(list(zip(order, after)))]
    return forward + backward


def block_module_accesses(model, profile, trace) -> tuple[list[Access], dict[str, int]]:  # type: ignore[no-untyped-def]
    """The access sequence over the modules of ``profile``'s blocks that own parameters, and their
    parameter bytes in ``model``."""
    units = [m for b in profile.blocks for m in b.modules]
    sizes = {u: sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                    if n == u or n.startswith(u + ".")) for u in units}
    sizes = {u: s for u, s in sizes.items() if s}
    return [a for a in access_sequence(trace, list(sizes)) if a.unit in sizes], sizes


def static_block_traffic(accesses: Sequence[Access], sizes: dict[str, int], budget: int) -> int:
    """Bytes fetched per iteration when a fixed set of units stays resident: units are kept in order of
    first use while they fit next to the activation peak; the rest are fetched at every use (one
    staging buffer of the largest fetched unit is charged against the room)."""
    peak = max(a.activation_bytes for a in accesses)
    order = list(dict.fromkeys(a.unit for a in accesses))
    resident, used = set(), 0
    staging = max(sizes.values())
    for u in order:
        if used + sizes[u] + staging + peak <= budget:
            resident.add(u)
            used += sizes[u]
    if used + staging + peak > budget and len(resident) < len(order):
        raise ValueError(f"budget {budget} does not hold the activation peak {peak} and one staging buffer")
    return sum(sizes[a.unit] for a in accesses if a.unit not in resident)


def chunk_traffic(accesses: Sequence[Access], sizes: dict[str, int], budget: int, chunk_bytes: int) -> int:
    """Bytes fetched per iteration, in steady state, with parameters in chunks of ``chunk_bytes`` (a unit
    larger than a chunk spans several), placed by the trace: fetch on use, evict the chunk used furthest
    ahead."""
    # pack units into chunks in order of first use
    chunks_of: dict[str, list[int]] = {}
    chunk_sizes: list[int] = []
    for u in dict.fromkeys(a.unit for a in accesses):
        left = sizes[u]
        chunks_of[u] = []
        while left > 0 or not chunks_of[u]:
            if not chunk_sizes or chunk_sizes[-1] >= chunk_bytes:
                chunk_sizes.append(0)
            take = min(left, chunk_bytes - chunk_sizes[-1])
            chunk_sizes[-1] += take
            left -= take
            chunks_of[u].append(len(chunk_sizes) - 1)
            if take == 0:
                break
    # steady state: replay two iterations and count the second (the first starts from an empty device,
    # while the static placement's resident blocks are charged nothing)
    n_first = len(accesses)
    accesses = list(accesses) * 2
    uses = [(i, c) for i, a in enumerate(accesses) for c in chunks_of[a.unit]]
    next_use: dict[int, list[int]] = {}
    for i, c in reversed(uses):
        next_use.setdefault(c, []).append(i)
    resident: set[int] = set()
    moved = 0
    for i, a in enumerate(accesses):
        need = chunks_of[a.unit]
        for c in need:
            next_use[c].pop()  # this use
        room = budget - a.activation_bytes
        if sum(chunk_sizes[c] for c in need) > room:
            raise ValueError(f"budget {budget} does not hold {a.unit}'s chunks next to {a.activation_bytes} "
                             "bytes of activations")
        for c in need:
            if c not in resident:
                moved += chunk_sizes[c] if i >= n_first else 0
                resident.add(c)
        while sum(chunk_sizes[c] for c in resident) > room:
            victim = max((c for c in resident if c not in need),
                         key=lambda c: next_use[c][-1] if next_use[c] else len(accesses) + 1)
            resident.discard(victim)
    return moved
