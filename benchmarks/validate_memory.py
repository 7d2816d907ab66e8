"""Predicted vs measured memory on one H100: every ``block`` row of the calibration file (bytes saved for
backward by one GPT block, bf16 and autocast) and the whole-model reference (peak allocated), with the
error. Nothing here is fitted to these numbers; docs/cost_model.md reports the output.

    python benchmarks/validate_memory.py [path/to/h100-sxm_microbench.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from whalepy.hardware.cluster import ClusterSpec, NodeGroup
from whalepy.cost_models.memory import AUTOCAST_WEIGHT_COPY_BYTES
from whalepy.planner.estimate import estimate_from_profile
from whalepy.models import GPT, GPTConfig
from whalepy.frontend.profile import profile

DEFAULT = Path(__file__).resolve().parents[1].parent / "shared" / "calibration" / "h100-sxm_microbench.json"
GIB = 2**30


def _gpt(h: int, layers: int, heads: int, seq: int, vocab: int, batch: int):  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, num_layers=layers, num_heads=heads, hidden_size=h))
    return profile(model, (torch.zeros(batch, seq, dtype=torch.long, device="meta"),))


def block_rows(path: Path) -> None:
    rows = json.loads(path.read_text())["block"]
    cache: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    print("| h | seq | mb | mode | measured MiB | predicted MiB | error |\n|---|---|---|---|---|---|---|")
    errors = []
    for r in rows:
        key = (r["h"], r["seq"], r["mb"])
        if key not in cache:
            blk = next(b for b in _gpt(key[0], 2, key[0] // 128, key[1], 256, key[2]).blocks
                       if b.name == "transformer.h.1")
            cache[key] = (blk.activation_bytes, blk.input_bytes, blk.num_params)
        act, inp, n = cache[key]
        pred = act * 0.5 + ((inp * 0.5 + AUTOCAST_WEIGHT_COPY_BYTES * n) if r["mode"] == "autocast" else 0)
        err = pred / r["saved_bytes"] - 1
        errors.append(err)
        print(f"| {key[0]} | {key[1]} | {key[2]} | {r['mode']} | {r['saved_bytes'] / 2**20:.1f} | "
              f"{pred / 2**20:.1f} | {100 * err:+.1f}% |")
    print(f"\n{len(errors)} rows: error from {100 * min(errors):+.1f}% to {100 * max(errors):+.1f}%\n")


def whole_model() -> None:
    prof = _gpt(2048, 24, 16, 1024, 50304, 4)
    cluster = ClusterSpec(groups=(NodeGroup.build(name="h100", gpu="H100-SXM", gpus_per_node=1,
                                                  cpu_memory_bytes=128 * GIB),))
    measured = {"fp32": (30.3, 0.742), "bf16": (28.2, 0.127)}
    print("| run | measured GiB | predicted GiB | error | measured s/step | predicted | error |\n"
          "|---|---|---|---|---|---|---|")
    for prec, (mem, step) in measured.items():
        e = estimate_from_profile(prof, cluster, dict(dp=1), global_batch=4, precision=prec)
        got = e.stages[0].memory_bytes / GIB
        print(f"| {prec} | {mem} | {got:.1f} | {100 * (got / mem - 1):+.1f}% | {step} | {e.step_time_s:.3g} | "
              f"{100 * (e.step_time_s / step - 1):+.0f}% |")
        print(f"|   | breakdown: {e.stages[0].memory} |")


if __name__ == "__main__":
    block_rows(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
    whole_model()
