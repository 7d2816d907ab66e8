"""Predicted peak memory of a measured plan (``whalepy.plan(..., measure=True)``) against the peak its run
holds, with the blocks compiled (``compile=True``) and eager, bf16, one micro-batch (as the H200 runs of
docs/benchmarks.md), one CPU process.

    python benchmarks/bench_compiled_memory_cpu.py [--backend inductor]

The model is tests/compiled_memory_cases.py's small GPT (the CI test's, tests/test_memory_compiled.py);
the run's peak is the CPU allocator's over one ``train_step`` (``compiled_memory_cases.allocator_peak``).
``--backend``: the ``torch.compile`` backend of the compiled blocks, for the measurement and the run
(inductor, as on a GPU; CI uses ``aot_eager_decomp_partition``, inductor's partitioner without its code
generation)."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _run(plans, backend):  # type: ignore[no-untyped-def]
    import compiled_memory_cases as cases

    return [cases.run_plan(p, backend) for p in plans]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    import whalepy
    from whalepy.runtime import compile_blocks

    import compiled_memory_cases as cases
    from dist_harness import run_distributed

    compile_blocks.BACKEND = args.backend
    plans = []
    for compiled in (True, False):
        model, x = cases.build()
        plans.append(whalepy.plan(model, whalepy.ClusterSpec.local(1), global_batch=cases.BATCH, example_inputs=(x,),
                                  measure=True, compile=compiled, precision="bf16", time_limit_s=20,
                                  max_microbatches=1))
    rows = run_distributed(_run, 1, plans, args.backend, timeout=3000)[0]
    for p, (pred, peak) in zip(plans, rows):
        c = p.stages[0].cost
        print(f"compile={p.compile} ({args.backend if p.compile else 'eager'}), {p.num_microbatches} micro-batch(es): "
              f"predicted {pred / 2**20:.2f} MiB (activations {c.activation_bytes / 2**20:.2f}, autocast weight "
              f"copies {c.autocast_copy_bytes / 2**20:.2f}), run's peak {peak / 2**20:.2f} MiB: "
              f"{pred / peak - 1:+.1%}")


if __name__ == "__main__":
    main()
