"""Collective communication costs: alpha-beta model over a two-level (intra-node / inter-node) hierarchy.

The dataclasses below are the contract; the estimate_* functions are filled in by the cost-model work.
"""

from __future__ import annotations

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
