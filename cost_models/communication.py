"""Collective communication costs: alpha-beta model over a two-level (intra-node / inter-node) hierarchy.

A message of ``n`` bytes over a link of bandwidth ``B`` and latency ``a`` costs ``a + n / B`` (Hockney,
"The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 1994). The
collective formulas below compose that cost step by step, following Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005) and, for the
bandwidth-optimal ring, Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations" (JPDC 2009). ``Link.bandwidth`` is used as given: a cluster spec that wants achieved rather
than nominal bandwidth (NCCL bus bandwidth) supplies it there. Every formula is in docs/cost_model.md.

Size conventions (``nbytes``): all-reduce, broadcast, send/recv: the tensor; all-gather: the gathered
output; reduce-scatter: the full input before scattering; all-to-all: one rank's whole send buffer.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One level of the interconnect as seen by a single rank."""

    bandwidth: float
    """Bytes/s per direction: per GPU for an intra-node link, per node for the network."""
    latency: float
    """Seconds per message (the alpha term)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CommGroup:
    """A set of ranks taking part in one collective: ``ranks_per_node`` on each of ``num_nodes`` nodes.

    ``intra`` is the slowest intra-node link among the nodes involved (bandwidth per GPU per direction);
    ``inter`` the slowest network path between them, with ``bandwidth`` the whole node's network
    bandwidth per direction, shared by the node's ranks that use it at once.
    """

    ranks_per_node: int
    num_nodes: int
    intra: Link
    inter: Link

    @property
    def size(self) -> int:
        return self.ranks_per_node * self.num_nodes


class Collective(str, enum.Enum):
    """Collective operation kind."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"


class Algorithm(str, enum.Enum):
    """Collective algorithm: bandwidth-optimal ring, or latency-optimal binomial tree."""

    RING = "ring"
    TREE = "tree"


def estimate_p2p_time(nbytes: float, link: Link) -> float:
    """One message of ``nbytes`` over ``link``: ``a + n / B``; nothing is sent for 0 bytes."""
    _check_bytes(nbytes)
    if nbytes == 0:
        return 0.0
    return link.latency + nbytes / link.bandwidth


def estimate_flat_collective_time(
    collective: Collective | str,
    nbytes: float,
    num_ranks: int,
    link: Link,
    algorithm: Algorithm | str = Algorithm.RING,
) -> float:
    """Seconds for one collective among ``num_ranks`` ranks that all talk over the same ``link``.

    With ``p`` ranks, ``n`` bytes (see the module docstring for what ``n`` is), bandwidth ``B`` and
    latency ``a``:

    ring: all-reduce ``2(p-1)(a + n/(pB))`` (reduce-scatter then all-gather, Patarasuk & Yuan 2009);
    all-gather, reduce-scatter and all-to-all ``(p-1)(a + n/(pB))`` (pairwise exchange for all-to-all,
    Thakur et al. 2005); broadcast, pipelined along the ring, ``(p-1)a + n/B``.
    tree (binomial, unpipelined, Thakur et al. 2005): all-reduce = reduce + broadcast
    ``2 ceil(log2 p)(a + n/B)``; broadcast ``ceil(log2 p)(a + n/B)``. Other collectives have no tree
    form here and raise ``ValueError``.
    send/recv: ``a + n/B`` whatever the algorithm.

    One rank, or zero bytes, costs nothing: no collective is issued.
    """
    collective, algorithm = _check_algorithm(collective, algorithm)
    _check_bytes(nbytes)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    if link.bandwidth <= 0 or link.latency < 0:
        raise ValueError(f"link needs positive bandwidth and non-negative latency, got {link}")
    if collective is Collective.SEND_RECV:
        return estimate_p2p_time(nbytes, link)
    p, n, a, bw = num_ranks, nbytes, link.latency, link.bandwidth
    if p == 1 or n == 0:
        return 0.0
    if algorithm is Algorithm.TREE:
        depth = math.ceil(math.log2(p))
        if collective is Collective.ALL_REDUCE:
            return 2 * depth * (a + n / bw)
        return depth * (a + n / bw)  # broadcast, the only other collective _check_algorithm lets through
    step = a + n / (p * bw)
    if collective is Collective.ALL_REDUCE:
        return 2 * (p - 1) * step
    if collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (p - 1) * step
    if collective is Collective.BROADCAST:
        return (p - 1) * a + n / bw
    raise ValueError(f"unhandled collective {collective!r}")  # pragma: no cover


def estimate_collective_time(
    collective: Collective | str,
    nbytes: float,
    group: CommGroup,
    algorithm: Algorithm | str = Algorithm.RING,
) -> float:
    """Seconds for one collective over a two-level ``group`` (``r`` ranks on each of ``m`` nodes).

    One node: flat over ``group.intra``. One rank per node: flat over ``group.inter`` (that rank has the
    node's whole NIC). Otherwise the collective is split into intra-node and inter-node phases. In an
    inter-node phase the ``r`` ranks of a node run ``r`` concurrent rings that share the NIC, so each
    sees ``inter.bandwidth / r``. ``algorithm`` applies to the inter-node phase; intra-node phases are
    rings (NVLink rings in NCCL).

    - all-reduce: intra reduce-scatter(n) + inter all-reduce(n/r) + intra all-gather(n);
    - all-gather: inter all-gather(n/r) + intra all-gather(n) (reduce-scatter mirrors it);
    - all-to-all: each rank sends ``n/p`` to each peer; its ``r(m-1)`` inter-node pieces,
      ``n(m-1)/m`` bytes, leave through a NIC carrying ``r`` such streams, concurrently with its
      ``r-1`` intra-node pieces: ``max((r-1)(a_intra + n/(p B_intra)),
      r(m-1) a_inter + r n (m-1) / (m B_inter))``;
    - broadcast: inter broadcast among one rank per node (whole NIC) + intra broadcast;
    - send/recv: one message across nodes over the inter link.
    """
    collective, algorithm = _check_algorithm(collective, algorithm)
    _check_bytes(nbytes)
    r, m = group.ranks_per_node, group.num_nodes
    if r < 1 or m < 1:
        raise ValueError(f"group needs ranks_per_node >= 1 and num_nodes >= 1, got {r} and {m}")
    flat = estimate_flat_collective_time
    if m == 1:
        return flat(collective, nbytes, r, group.intra, algorithm)
    if r == 1 or collective is Collective.SEND_RECV:
        return flat(collective, nbytes, m, group.inter, algorithm)
    shared_nic = Link(bandwidth=group.inter.bandwidth / r, latency=group.inter.latency)
    n, ring = nbytes, Algorithm.RING
    if collective is Collective.ALL_REDUCE:
        return (
            flat(Collective.REDUCE_SCATTER, n, r, group.intra, ring)
            + flat(Collective.ALL_REDUCE, n / r, m, shared_nic, algorithm)
            + flat(Collective.ALL_GATHER, n, r, group.intra, ring)
        )
    if collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return flat(collective, n / r, m, shared_nic, algorithm) + flat(collective, n, r, group.intra, ring)
    if collective is Collective.ALL_TO_ALL:
        if n == 0:
            return 0.0
        p = r * m
        intra_s = (r - 1) * (group.intra.latency + n / (p * group.intra.bandwidth))
        inter_s = r * (m - 1) * group.inter.latency + r * n * (m - 1) / (m * group.inter.bandwidth)
        return max(intra_s, inter_s)
    if collective is Collective.BROADCAST:
        return flat(collective, n, m, group.inter, algorithm) + flat(collective, n, r, group.intra, ring)
    raise ValueError(f"unhandled collective {collective!r}")  # pragma: no cover


def _check_bytes(nbytes: float) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be non-negative, got {nbytes}")


_TREE_COLLECTIVES = (Collective.ALL_REDUCE, Collective.BROADCAST, Collective.SEND_RECV)


def _check_algorithm(
    collective: Collective | str, algorithm: Algorithm | str
) -> tuple[Collective, Algorithm]:
    collective, algorithm = Collective(collective), Algorithm(algorithm)
    if algorithm is Algorithm.TREE and collective not in _TREE_COLLECTIVES:
        raise ValueError(f"no tree algorithm is modelled for {collective.value}; use Algorithm.RING")
    return collective, algorithm
