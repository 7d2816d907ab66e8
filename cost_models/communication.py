"""Collective communication costs: alpha-beta model over a two-level (intra-node / inter-node) hierarchy.

A message of ``n`` bytes over a link of bandwidth ``B`` and latency ``a`` costs ``a + n / B`` (Hockney,
"The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 1994). The
collective formulas below compose that cost step by step, following Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005) and, for the
bandwidth-optimal ring, Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations" (JPDC 2009). ``Link.bandwidth`` is the nominal (line-rate) bandwidth and ``Link.efficiency``
the share of it NCCL achieves as *bus bandwidth* on large messages (nccl-tests' ``busbw``, which
factors out the algorithm: ``busbw = algbw * 2(p-1)/p`` for all-reduce, ``(p-1)/p`` for all-gather and
reduce-scatter, NCCL's doc/PERFORMANCE.md in nccl-tests). Every formula uses
``Link.achieved_bandwidth = bandwidth * efficiency``; :data:`BUS_EFFICIENCY` gives the sourced value per
:class:`Fabric`, and a calibrated device profile can build its links with measured ones instead.
Small messages are latency-dominated through the alpha term (per ring step) plus a per-collective
``CommGroup.launch_latency``. Every formula is in docs/cost_model.md.

Size conventions (``nbytes``): all-reduce, broadcast, send/recv: the tensor; all-gather: the gathered
output; reduce-scatter: the full input before scattering; all-to-all: one rank's whole send buffer.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Fabric(str, enum.Enum):
    """Kind of link, for its achieved share of the line rate (:data:`BUS_EFFICIENCY`)."""

    NVLINK = "nvlink"
    """NVLink / NVSwitch (and AMD xGMI), any generation without a measured figure of its own."""
    NVLINK3 = "nvlink3"
    """A100 NVLink 3 / NVSwitch 2."""
    NVLINK4 = "nvlink4"
    """H100 / H200 NVLink 4 / NVSwitch 3."""
    PCIE = "pcie"
    """GPUs talking over PCIe (through switches or the CPU's root complex)."""
    NETWORK = "network"
    """RDMA network between nodes: InfiniBand or RoCE with GPUDirect."""
    ETHERNET = "ethernet"
    """Plain TCP sockets between nodes (NCCL's socket transport)."""
    GIVEN = "given"
    """A bandwidth the user measured or gave explicitly: used as is."""


BUS_EFFICIENCY: dict[Fabric, float] = {
    Fabric.NVLINK: 0.8,
    Fabric.NVLINK3: 0.7,
    Fabric.NVLINK4: 0.82,
    Fabric.PCIE: 0.5,
    Fabric.NETWORK: 0.96,
    Fabric.ETHERNET: 0.6,
    Fabric.GIVEN: 1.0,
}
"""Achieved NCCL bus bandwidth on large messages as a share of the nominal per-direction bandwidth.

- NVLink: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective
  NVLink bandwidth of 370GB/s" (S. Jeaugey, NCCL maintainer, NVIDIA/nccl-tests#212, H100): 0.82 for
  NVLink 4, 0.8 for generations without their own figure;
- NVLink 3 (A100, 300 GB/s): 8-GPU all_reduce_perf bus bandwidth 200-208 GB/s in NVIDIA/nccl-tests#149
  (HPE Apollo 6500, 8 x A100-80GB) and #178: 0.7;
- PCIe: 28 GB/s bus bandwidth on 8 GPUs and 35 GB/s on 4 on PCIe 5.0 x16 (64 GB/s), "On PCI systems,
  the performance you get is usually determined by the bandwidth your CPU and memory can deliver"
  (NVIDIA/nccl#1639): about 0.5;
- InfiniBand / RoCE: 3 nodes of 8 A100 with 4 x HDR 200 Gb/s per node (100 GB/s per node), all-reduce
  bus bandwidth peaking at 96 GB/s (NVIDIA/nccl-tests#119): 0.96;
- plain TCP Ethernet: NAMED CONSTANT 0.6, no measurement at hand; the socket transport copies through
  host memory and its throughput depends on the number of sockets and threads (NCCL_NSOCKS_PERTHREAD,
  NCCL_SOCKET_NTHREADS); calibrate it where it matters;
- given: the user's own number, taken as achieved.
"""

NCCL_LAUNCH_LATENCY_S = 8.4e-6
"""Fixed cost of one NCCL collective besides its per-step latency: NCCL's ``baseLat`` for the ring
algorithm with the Simple protocol (src/graph/tuning.cc), which NCCL's own tuner adds once per call."""


def bus_efficiency(fabric: Fabric | str) -> float:
    """:data:`BUS_EFFICIENCY` of ``fabric`` (raises on an unknown kind)."""
    return BUS_EFFICIENCY[Fabric(fabric)]


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One level of the interconnect as seen by a single rank."""

    bandwidth: float
    """Nominal bytes/s per direction: per GPU for an intra-node link, per node for the network."""
    latency: float
    """Seconds per message (the alpha term)."""
    efficiency: float = 1.0
    """Share of ``bandwidth`` NCCL achieves as bus bandwidth (:data:`BUS_EFFICIENCY`, or calibrated)."""

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"link efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def achieved_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency

    def shared(self, sharers: int) -> Link:
        """This link with its bandwidth split between ``sharers`` concurrent streams."""
        return Link(bandwidth=self.bandwidth / sharers, latency=self.latency, efficiency=self.efficiency)


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
    launch_latency: float = 0.0
    """Fixed seconds per collective call (:data:`NCCL_LAUNCH_LATENCY_S` for NCCL groups)."""
    reduce_scatter_as_all_reduce: bool = False
    """The backend runs a reduce-scatter as an all-reduce of the whole input (gloo, CPU ranks: torch's
    ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``, which ``_reduce_scatter_base`` calls, clones
    the input, all-reduces the clone and copies this rank's chunk out), so it costs an all-reduce of its
    input bytes, not a ring reduce-scatter's half of one."""

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


def estimate_p2p_time(nbytes: float, link: Link, call_latency: float = 0.0) -> float:
    """One message of ``nbytes`` over ``link``: ``L + a + n / B``; nothing is sent for 0 bytes.

    ``call_latency`` (``L``) is the fixed cost of one call on the pair's backend, the
    :attr:`CommGroup.launch_latency` its collectives pay: a send is a call like them (gloo wakes its
    threads for it and the receiver waits for both ranks to reach it; NCCL launches it as a kernel)."""
    _check_bytes(nbytes)
    if nbytes == 0:
        return 0.0
    return call_latency + link.latency + nbytes / link.achieved_bandwidth


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
    p, n, a, bw = num_ranks, nbytes, link.latency, link.achieved_bandwidth
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

    ``group.launch_latency`` is added once to every call that moves data, a send/recv included. Where
    ``group.reduce_scatter_as_all_reduce`` (gloo), a reduce-scatter of ``n`` input bytes is timed as the
    all-reduce of ``n`` bytes the backend runs.
    """
    collective, algorithm = _check_algorithm(collective, algorithm)
    collective = _as_run(collective, group)
    _check_bytes(nbytes)
    r, m = group.ranks_per_node, group.num_nodes
    if r < 1 or m < 1:
        raise ValueError(f"group needs ranks_per_node >= 1 and num_nodes >= 1, got {r} and {m}")
    if nbytes == 0 or group.size == 1:
        return 0.0
    return group.launch_latency + _hierarchical_time(collective, nbytes, group, algorithm)


def _hierarchical_time(collective: Collective, nbytes: float, group: CommGroup, algorithm: Algorithm) -> float:
    r, m = group.ranks_per_node, group.num_nodes
    flat = estimate_flat_collective_time
    if m == 1:
        return flat(collective, nbytes, r, group.intra, algorithm)
    if r == 1 or collective is Collective.SEND_RECV:
        return flat(collective, nbytes, m, group.inter, algorithm)
    shared_nic = group.inter.shared(r)
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
        intra_s = (r - 1) * (group.intra.latency + n / (p * group.intra.achieved_bandwidth))
        inter_s = r * (m - 1) * group.inter.latency + r * n * (m - 1) / (m * group.inter.achieved_bandwidth)
        return max(intra_s, inter_s)
    if collective is Collective.BROADCAST:
        return flat(collective, n, m, group.inter, algorithm) + flat(collective, n, r, group.intra, ring)
    raise ValueError(f"unhandled collective {collective!r}")  # pragma: no cover


def _flat_sent_bytes(collective: Collective, nbytes: float, p: int) -> float:
    """Bytes one rank sends in a flat collective among ``p`` ranks (the algorithms of
    :func:`estimate_flat_collective_time`, ring form)."""
    if p == 1 or nbytes == 0:
        return 0.0
    if collective is Collective.ALL_REDUCE:
        return 2 * (p - 1) / p * nbytes
    if collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (p - 1) / p * nbytes
    return nbytes  # broadcast (pipelined along the ring: every rank but the last forwards it), send/recv


def estimate_collective_link_bytes(collective: Collective | str, nbytes: float, group: CommGroup) -> tuple[float, float]:
    """``(intra-node, inter-node)`` bytes the busiest rank sends for one collective of ``nbytes`` payload over
    ``group``, phase by phase as :func:`estimate_collective_time` times it (ring algorithms):

    - all-reduce: intra reduce-scatter + all-gather ``2 (r-1)/r n``; inter all-reduce of ``n/r``:
      ``2 (m-1)/m n/r``;
    - all-gather, reduce-scatter: intra ``(r-1)/r n``; inter ``(m-1)/m n/r``;
    - all-to-all: intra ``(r-1) n/p``; inter ``(m-1)/m n``;
    - broadcast: ``n`` on each level that has more than one participant (the node's leader rank forwards
      it over the network); send/recv: ``n`` across nodes when the group spans nodes.
    """
    collective = _as_run(Collective(collective), group)
    _check_bytes(nbytes)
    r, m, n = group.ranks_per_node, group.num_nodes, nbytes
    if n == 0 or group.size == 1:
        return 0.0, 0.0
    if m == 1:
        return _flat_sent_bytes(collective, n, r), 0.0
    if r == 1 or collective is Collective.SEND_RECV:
        return 0.0, _flat_sent_bytes(collective, n, m)
    if collective is Collective.ALL_REDUCE:
        return 2 * (r - 1) / r * n, _flat_sent_bytes(Collective.ALL_REDUCE, n / r, m)
    if collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return _flat_sent_bytes(collective, n, r), _flat_sent_bytes(collective, n / r, m)
    if collective is Collective.ALL_TO_ALL:
        return (r - 1) * n / (r * m), (m - 1) / m * n
    return n, n  # broadcast


def _as_run(collective: Collective, group: CommGroup) -> Collective:
    """The collective the backend runs for ``collective`` (:attr:`CommGroup.reduce_scatter_as_all_reduce`)."""
    if collective is Collective.REDUCE_SCATTER and group.reduce_scatter_as_all_reduce:
        return Collective.ALL_REDUCE
    return collective


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


# -- overlap of communication with compute ------------------------------------------------------------

OVERLAP_COMPUTE_LOSS = 0.15
"""Share of compute throughput lost while a collective runs beside it. NAMED CONSTANT with its reason:
an NCCL collective runs as one CTA (thread block) per channel on the GPU's SMs, and NCCL uses 16 to 32
channels on NVLink / NVSwitch systems (``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS``, NCCL
environment documentation), so an overlapped GEMM loses about 16/108 (A100) to 32/132 (H100) of the
SMs, 0.12 to 0.24, besides memory bandwidth; 0.15 is the low end of that range. A calibrated profile
should replace it with a measured slowdown."""


CPU_OVERLAP_LOSS = 1.0
"""The same share for CPU ranks (gloo): none of a collective hides behind compute. MEASURED, with its
reason: a gloo collective makes progress on threads of the rank's own process, on the same cores the
rank computes on, so where ranks fill the cores (torchrun's default: one intra-op thread per rank, a
rank per core) the collective and the compute take turns. ``benchmarks/bench_predict_cpu.py`` measures
it on each run (two ranks, 2 cores, 2026-11-27: 6 GEMMs of 2.0 ms then a 256 KiB all-gather 3.9-4.3 ms
per iteration serially, 4.9 ms with the all-gather issued asynchronously before the GEMMs): overlap
gains nothing, so the exposed time is the collective's whole time."""


def overlap_loss(device: object) -> float:
    """:data:`OVERLAP_COMPUTE_LOSS` for an accelerator, :data:`CPU_OVERLAP_LOSS` for a CPU device type
    (``vendor == "cpu"``)."""
    return CPU_OVERLAP_LOSS if getattr(device, "vendor", None) == "cpu" else OVERLAP_COMPUTE_LOSS


def estimate_overlapped_time(compute_s: float, comm_s: float, *, loss: float = OVERLAP_COMPUTE_LOSS) -> float:
    """Seconds of ``compute_s`` of compute run beside ``comm_s`` of communication that starts with it.

    While the collective runs, compute progresses at ``1 - loss`` of its speed; afterwards at full
    speed. If the compute outlasts the collective it finishes at ``compute + loss * comm``; otherwise
    the collective is the critical path: ``max(compute + loss * comm, comm)``. The exposed part is this
    minus ``compute_s``.
    """
    if compute_s < 0 or comm_s < 0 or not 0 <= loss <= 1:
        raise ValueError(f"compute_s ({compute_s}) and comm_s ({comm_s}) must be >= 0 and loss ({loss}) "
                         "in [0, 1]")
    return max(compute_s + loss * comm_s, comm_s)
