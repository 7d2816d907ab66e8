"""The full-size plans of ``whalepy check`` (issue 23), built at any depth (no tests here).

``tests/test_rank_check_full.py`` lowers them in CI at full width and full world size with fewer
layers; ``benchmarks/bench_rank_check.py`` lowers them at full depth. Each case is a plan from
``estimate_from_profile`` (so it carries the cost model's predictions), the model builder ``whalepy
check`` calls once per rank (the model on the meta device) and the profile and cluster it was made for:

- ``gpt3``: GPT-3 175B's shape (whalepy's GPT: hidden 12,288, 96 heads, vocabulary 50,257, sequence
  2,048, tied embeddings; Brown et al. 2020, Table 2.1) on 1,024 A100 (``examples/clusters/
  a100_128x8.yaml``), pp 8 x dp 16 x tp 8, ZeRO-1, 12 micro-batches of a global batch of 1,536, bf16
  (the layout of Narayanan et al., SC'21, Table 1);
- ``llama70b``: Llama-2 70B's shape (whalepy.models.llama, no transformers) on 32 A100 + 32 L40S
  (``examples/clusters/mixed_a100_l40s_70b.yaml``), pp 4 x dp 4 x tp 4, ZeRO-3, uneven stages (26 / 22 /
  18 / 16 blocks at full depth), per-block tiers (4 of stage 0's layers and 2 of stage 1's keep their
  parameters and optimizer states in host memory at full depth, 1 and 1 when shallower: the tier pair
  ``(cpu, cpu)`` beside ``(gpu, gpu)``) and uneven batch shares (A100 replicas 40, L40S replicas 24), bf16;
- ``interleaved``: the GPT-3 shape, pp 4 x 2 virtual stages x dp 32 x tp 8 on the same 1,024 A100,
  ZeRO-3: the tied embedding and head on the first and the last virtual stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = ROOT / "examples" / "clusters"


@dataclass(frozen=True)
class Case:
    plan: Any
    build: Callable[[], tuple[Any, tuple]]
    profile: Any
    cluster: Any


def gpt3_model(layers: int = 96) -> tuple[Any, tuple]:
    from whalepy.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=50257, block_size=2048, num_layers=layers, num_heads=96, hidden_size=12288,
                    tie_embeddings=True, gelu_approximate="tanh")
    with torch.device("meta"):
        model = GPT(cfg)
    return model.eval(), (torch.zeros(1, 2048, dtype=torch.long, device="meta"),)


def llama70b_model(layers: int = 80) -> tuple[Any, tuple]:
    from whalepy.models.llama import LLAMA_70B, Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(**{**LLAMA_70B, "num_layers": layers}))
    return model.eval(), (torch.zeros(1, 4096, dtype=torch.long, device="meta"),)


@functools.cache
def _profile(kind: str, layers: int) -> Any:
    from whalepy.frontend.profile import profile

    model, inputs = (gpt3_model if kind == "gpt" else llama70b_model)(layers)
    return profile(model, inputs)


def _uneven(blocks: int) -> tuple[int, ...]:
    """Four stage sizes in blocks in the proportions 13 : 11 : 9 : 8, the last taking what rounding
    leaves (26 / 22 / 18 / 16 of Llama-70B's 82 blocks): the first stages longer, uneven on purpose."""
    sizes = [round(blocks * w / 41) for w in (13, 11, 9)]
    return (*sizes, blocks - sum(sizes))


def case(name: str, layers: int | None = None) -> Case:
    """The case ``name`` (``gpt3``, ``llama70b``, ``interleaved``) with ``layers`` decoder layers (the
    model's own number if None)."""
    from whalepy.hardware.cluster import ClusterSpec
    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

    if name in ("gpt3", "interleaved"):
        L = 96 if layers is None else layers
        cluster = ClusterSpec.load(CLUSTERS / "a100_128x8.yaml")
        if name == "gpt3":
            config = ParallelConfig(pp=8, dp=16, tp=8, zero_stage=1, num_microbatches=12)
            batch = 1536
        else:
            config = ParallelConfig(pp=4, dp=32, tp=8, zero_stage=3, num_microbatches=8,
                                    schedule="interleaved_1f1b", virtual_stages=2)
            batch = 32 * 8
        kind, build = "gpt", functools.partial(gpt3_model, L)
    elif name == "llama70b":
        L = 80 if layers is None else layers
        cluster = ClusterSpec.load(CLUSTERS / "mixed_a100_l40s_70b.yaml")
        config = ParallelConfig(pp=4, dp=4, tp=4, zero_stage=3, num_microbatches=4, layout="replicas",
                                boundaries=_uneven(L + 2), batch_shares=(40, 40, 24, 24),
                                host_blocks=(max(1, L // 20), max(1, L // 40), 0, 0))
        batch = 128
        kind, build = "llama", functools.partial(llama70b_model, L)
    else:
        raise ValueError(f"no case {name!r}")
    prof = _profile(kind, L)
    plan = estimate_from_profile(prof, cluster, config, global_batch=batch, precision="bf16").plan
    return Case(plan=plan, build=build, profile=prof, cluster=cluster)
