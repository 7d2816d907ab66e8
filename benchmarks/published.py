"""Published training measurements that validate whalepy's cost model (never used to fit it).

Transcribed from the project's calibration notes (shared/calibration/published.md); citations below.
"""

from __future__ import annotations

MEGATRON_SC21 = ("Narayanan et al., \"Efficient Large-Scale Language Model Training on GPU Clusters Using "
                 "Megatron-LM\", SC'21, Table 1 (weak scaling, GPT, A100-80GB SXM, DGX A100 nodes: 8 GPUs on "
                 "NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node); micro-batch and interleaving from "
                 "examples/sc21/run_table_1.sh in NVIDIA/Megatron-LM")
"""Sequence 2048, vocabulary 51200, fp16, full recomputation of every layer; throughput counted as
``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` FLOPs per iteration."""

SEQ, VOCAB = 2048, 51200

# params, heads, hidden, layers, TP, PP, GPUs, batch, micro-batch, v, TFLOP/s per GPU, % of peak
TABLE1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137, 44),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138, 44),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142, 46),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135, 43),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138, 44),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140, 45),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148, 47),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155, 50),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163, 52),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163, 52),
]

ZERO_SC20 = "Rajbhandari et al., \"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models\", SC'20"
# parameters, data-parallel degree, GB per GPU for ZeRO stages 1, 2, 3 (mixed-precision Adam, K = 12)
ZERO_MODEL_STATES = (7.5e9, 64, {1: 31.4, 2: 16.6, 3: 1.88})

KORTHIKANTI = ("Korthikanti et al., \"Reducing Activation Recomputation in Large Transformer Models\", 2022 "
               "(A100-80GB)")
# 22B GPT: hidden, heads, sequence, micro-batch, TP; per-layer milliseconds
KORTHIKANTI_22B = dict(hidden=6144, heads=64, seq=2048, micro_batch=4, tp=8,
                       forward_ms=7.7, backward_ms=11.9, backward_full_recompute_ms=19.5,
                       backward_selective_recompute_ms=13.2)


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per iteration as Narayanan et al. count them (with recomputation)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
