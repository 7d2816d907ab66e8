"""Capacity frontier of the memory tiers: published cases of ZeRO-Offload, ZeRO-Infinity and PatrickStar
(what fits and what does not on given GPUs, host memory and NVMe), planned by whalepy's planner.

For every published success the planner must find a plan that fits; for every published (or implied)
failure it must find none (``InfeasibleError``). Nothing is fitted to these rows: the bytes are the
runtime's (``estimate_model_state_bytes``), the capacities the hardware's. The margin is the headroom
of the tightest resource: for a success, of the plan found (device memory per GPU, host memory and
NVMe per node); for a failure, how far the leanest configuration in the allowed tiers (ZeRO-3 over
every GPU, every block checkpointed, one sample per micro-batch) is from fitting.

A success that needs a tier pair the runtime does not lower (``state_option_error``) is reported as
``PENDING`` with the reason, not as a pass.

    python benchmarks/validate_offload.py          # the table of docs/cost_model.md, "Offload"
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from whalepy.errors import InfeasibleError
from whalepy.hardware.cluster import ClusterSpec, NodeGroup, NvmeSpec
from whalepy.cost_models.devices import GIB
from whalepy.planner._tiling_costs import MAX_TILES
from whalepy.planner.synthetic import transformer_profile

DGX2_HOST_BYTES = 1536 * GIB
"""DGX-2 system memory, 1.5 TB (NVIDIA DGX-2 datasheet; ZeRO-Offload and ZeRO-Infinity ran on DGX-2)."""
DGX2_NVME = NvmeSpec(capacity_bytes=int(28e12), read_bandwidth=25e9, write_bandwidth=25e9)
"""DGX-2 NVMe: 28 TB per node as ZeRO-Infinity counts it (Rajbhandari et al., SC'21, Fig. 2b; the
datasheet's 8 x 3.84 TB = 30.7 TB raw) and its ~25 GB/s aggregate. Bandwidths only move step times,
not this frontier."""
PATRICKSTAR_HOST_BYTES = int(240e9)
"""PatrickStar's node: 8 V100-32GB and 240 GB of CPU memory (Fang et al., "PatrickStar: Parallel
Training of Pre-trained Models via Chunk-based Dynamic Memory Management", TPDS 2023 / arXiv
2108.05818; README of Tencent/PatrickStar)."""


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int = 1024
    vocab: int = 50257


@dataclass(frozen=True)
class Case:
    system: str
    claim: str
    """What the source says, in a few words."""
    source: str
    model: Model
    gpus_per_node: int
    nodes: int
    host_bytes: int | None
    nvme: NvmeSpec | None
    allow_offload: bool
    fits: bool
    """The published outcome: trained (True) or did not fit (False)."""
    implied: bool = False
    """A failure the source implies from its own memory analysis rather than reports as a run."""


GPT13B = Model("13B (GPT-3 13B shape)", 40, 5120, 40)
GPT1_4B = Model("1.4B", 40, 1600, 25)
GPT70B = Model("70B", 86, 8192, 64)
GPT1T = Model("1T (Megatron 1T shape)", 128, 25600, 160)
GPT32T = Model("32T", 620, 65536, 512)
GPT18B = Model("18B", 40, 6144, 48)

ZO = "Ren et al., ZeRO-Offload, USENIX ATC'21"
ZI = "Rajbhandari et al., ZeRO-Infinity, SC'21"
PS = "Fang et al., PatrickStar, TPDS'23"

CASES = (
    Case("ZeRO-Offload", "13B on one V100-32GB", f"{ZO}, abstract and sec. 6", GPT13B, 1, 1,
         DGX2_HOST_BYTES, None, True, True),
    Case("ZeRO-Offload", "PyTorch alone: 13B does not fit one V100-32GB (its largest: 1.4B)",
         f"{ZO}, abstract", GPT13B, 1, 1, DGX2_HOST_BYTES, None, False, False),
    Case("ZeRO-Offload", "PyTorch alone: 1.4B on one V100-32GB", f"{ZO}, abstract", GPT1_4B, 1, 1,
         DGX2_HOST_BYTES, None, False, True),
    Case("ZeRO-Offload", "70B on one DGX-2 (16 V100-32GB) with model parallelism", f"{ZO}, abstract",
         GPT70B, 16, 1, DGX2_HOST_BYTES, None, True, True),
    Case("ZeRO-Offload", "70B without offload on one DGX-2 (model parallelism alone: 4.5x smaller)",
         f"{ZO}, abstract", GPT70B, 16, 1, DGX2_HOST_BYTES, None, False, False),
    Case("ZeRO-Infinity", "1T fine-tuned on one DGX-2 with NVMe", f"{ZI}, abstract and sec. 8", GPT1T, 16, 1,
         DGX2_HOST_BYTES, DGX2_NVME, True, True),
    Case("ZeRO-Infinity", "1T on one DGX-2 without NVMe (16 TB of model states > 1.5 TB host + 0.5 TB GPU)",
         f"{ZI}, sec. 3 / Fig. 2", GPT1T, 16, 1, DGX2_HOST_BYTES, None, True, False, implied=True),
    Case("ZeRO-Infinity", "32T on 512 V100-32GB (32 DGX-2) with NVMe", f"{ZI}, sec. 8.1", GPT32T, 16, 32,
         DGX2_HOST_BYTES, DGX2_NVME, True, True),
    Case("ZeRO-Infinity", "32T on 512 V100-32GB without offload (3D parallelism: ~50x smaller)",
         f"{ZI}, sec. 8.1", GPT32T, 16, 32, DGX2_HOST_BYTES, DGX2_NVME, False, False),
    Case("PatrickStar", "18B on 8 V100-32GB with 240 GB of CPU memory", f"{PS}; Tencent/PatrickStar README",
         GPT18B, 8, 1, PATRICKSTAR_HOST_BYTES, None, True, True),
    Case("PatrickStar", "18B on the same node without offload (16 bytes x 18B / 8 GPUs = 36 GB > 32 GB)",
         f"{PS}", GPT18B, 8, 1, PATRICKSTAR_HOST_BYTES, None, False, False, implied=True),
)


def cluster_of(case: Case) -> ClusterSpec:
    return ClusterSpec(groups=(NodeGroup.build(
        name="v100", gpu="V100-32GB", gpus_per_node=case.gpus_per_node, num_nodes=case.nodes,
        intra_link="nvlink2" if case.gpus_per_node > 1 else None,
        network_bandwidth=100e9 if case.nodes > 1 else None,  # DGX-2: 8 x 100 Gb/s InfiniBand
        cpu_memory_bytes=case.host_bytes, nvme=case.nvme),))


def profile_of(m: Model):  # type: ignore[no-untyped-def]
    return transformer_profile(num_layers=m.layers, hidden=m.hidden, seq_len=m.seq, vocab=m.vocab,
                               num_heads=m.heads, batch=1, name=m.name)


@dataclass
class Row:
    case: Case
    params: float
    planned: bool
    """The planner found a plan that fits."""
    margin: float
    """Headroom of the tightest resource: capacity / need - 1 (negative: short by that fraction)."""
    binding: str
    """The resource that binds (a failure's leanest configuration), or each resource's headroom in the
    plan found (a success: the planner spends device headroom on speed, so the GPU is near full by
    design; the host / NVMe headroom is the capacity frontier's)."""
    detail: str
    pending: str = ""
    """Why a success cannot be planned yet: the tier pair its mode needs is not lowered."""

    @property
    def holds(self) -> bool:
        return self.planned == self.case.fits


def _plan(case: Case):  # type: ignore[no-untyped-def]
    from whalepy.planner import plan_from_profile

    W = case.gpus_per_node * case.nodes
    return plan_from_profile(profile_of(case.model), cluster_of(case), global_batch=W,
                             allow_offload=case.allow_offload, allow_checkpoint_offload=case.allow_offload,
                             max_microbatches=8,
                             schedules=("1f1b",), time_limit_s=120, top_k=0)


def _node_margins(plan, cluster: ClusterSpec) -> list[tuple[float, str]]:  # type: ignore[no-untyped-def]
    """(headroom, resource) of every stage's devices and every node's host memory and NVMe."""
    from whalepy.cost_models.offload import host_capacity_per_gpu

    out = []
    for s in plan.stages:
        out.append((s.cost.capacity_bytes / max(1, s.cost.memory_bytes) - 1, "GPU memory"))
    placed = cluster.rank_devices()
    host, nvme = {}, {}
    for s in plan.stages:
        for rank in s.all_ranks:
            n = placed[rank].node
            host[n] = host.get(n, 0) + s.cost.cpu_bytes  # offloaded states and activations in host memory
            nvme[n] = nvme.get(n, 0) + s.cost.nvme_state_bytes
    g = cluster.groups[0]
    host_cap = host_capacity_per_gpu(g.cpu_memory_bytes, g.gpus_per_node)
    for n, b in host.items():
        if b and host_cap is not None:
            out.append((host_cap * g.gpus_per_node / b - 1, "host memory per node"))
    for n, b in nvme.items():
        if b and g.nvme is not None:
            out.append((g.nvme.capacity_bytes / b - 1, "NVMe per node"))
    return out


def _lean_margin(case: Case) -> tuple[float, str, str]:
    """How far the leanest configuration in the case's tiers is from fitting."""
    from whalepy.planner.estimate import estimate_from_profile

    W = case.gpus_per_node * case.nodes
    offload = None if not case.allow_offload else ("nvme" if case.nvme else "cpu")
    # the checkpointed inputs in host memory where the node has any (ZeRO-Infinity's activation checkpoints)
    cfg = dict(dp=W, zero_stage=3, checkpoint=True, offload=offload, offload_params=offload == "nvme",
               checkpoint_offload=case.host_bytes is not None)
    prof = profile_of(case.model)
    # tiles: the most the planner offers (the embedding and the head tile like the layers' linears, so
    # the largest unit tiling leaves whole is a layer's norms: every doubling shrinks the working set)
    cfg["tiles"] = MAX_TILES
    est = estimate_from_profile(prof, cluster_of(case), cfg, global_batch=W)
    m = min(_node_margins(est.plan, cluster_of(case)))
    what = "ZeRO-3 over all GPUs, all blocks checkpointed" + (" (inputs in host memory)" if cfg["checkpoint_offload"]
                                                              else "") + (f", offload={offload}" if offload else "")
    return m[0], m[1], what + (" (parameters too)" if offload == "nvme" else "") + f", tiles={cfg['tiles']}"


def _pending(case: Case) -> str:
    """Why the mode a success relies on is not lowered yet, or ''."""
    from whalepy.ir.rules import state_option_error

    if not case.fits or not case.allow_offload:
        return ""
    if case.nvme is not None:
        return state_option_error(3, "nvme", "nvme") or ""
    return ""


def run_case(case: Case) -> Row:
    params = profile_of(case.model).total_params
    try:
        plan = _plan(case)
    except InfeasibleError as e:
        try:
            margin, binding, how = _lean_margin(case)
        except Exception as lean_error:  # noqa: BLE001 -- the margin is informative; the verdict stands
            margin, binding, how = float("nan"), "-", f"no lean estimate: {lean_error}"
        pending = _pending(case)
        return Row(case, params, False, margin, binding, f"{how}; planner: {str(e).splitlines()[0][:160]}",
                   pending=pending if case.fits else "")
    margins = _node_margins(plan, cluster_of(case))
    m, binding = min(margins)
    worst = {}
    for x, name in margins:
        worst[name] = min(x, worst.get(name, x))
    binding = ", ".join(f"{name} {100 * x:+.0f}%" for name, x in worst.items())
    tiers = sorted({f"{b.param_tier.value}/{b.optimizer_tier.value}" for s in plan.stages for b in s.blocks})
    tiles = max(b.tiles for s in plan.stages for b in s.blocks)
    s0 = plan.stages[0]
    return Row(case, params, True, m, binding,
               f"pp={plan.pp_degree} dp={plan.dp_degree} tp={s0.tp_degree} ZeRO-{int(s0.zero_stage)} "
               f"tiers(param/opt) {','.join(tiers)}" + (f" tiles={tiles}" if tiles > 1 else ""))


def table(rows: list[Row]) -> str:
    out = ["| system | published | params | outcome | planner | margin | headroom by resource | plan / leanest |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.case
        verdict = "feasible" if r.planned else "infeasible"
        status = "PENDING: " + r.pending if r.pending else ("ok" if r.holds else "WRONG")
        out.append(f"| {c.system} | {c.claim} ({c.source}) | {r.params / 1e9:.3g}B | "
                   f"{'fits' if c.fits else 'does not fit'}{' (implied)' if c.implied else ''} | {verdict}: {status} | "
                   f"{100 * r.margin:+.0f}% | {r.binding} | {r.detail} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    rows = [run_case(c) for c in CASES]
    print(table(rows))
    wrong = [r for r in rows if not r.holds and not r.pending]
    pending = [r for r in rows if r.pending]
    print(f"\n{len(rows)} cases: {len(rows) - len(wrong) - len(pending)} hold, {len(pending)} pending a runtime "
          f"mode, {len(wrong)} wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
