"""The kernels of the step whalepy runs on one GPU, as a table: what the analytic model of compiled
blocks (docs/cost_model.md, "Compiled blocks") is checked against.

For each model of ``bench_gpu_step.py`` (same shapes, global batch 4 x 1024), whalepy plans for this
GPU and lowers the plan (compiled blocks and the fused optimizer where the plan says so), runs
``--warmup`` steps, then one step under ``torch.profiler``. Written to ``--out`` (a folder): per model
``<model>_kernels.txt``, the device kernels by total time (name, calls, total and mean microseconds),
and ``<model>_summary.json`` with the totals per kernel family (GEMM, attention, triton-fused, cast /
copy, elementwise, reduction, optimizer, other) and the plan's compile / optimizer settings.

    python benchmarks/profile_gpu_step.py --out /tmp/kernels            # one GPU
    python benchmarks/profile_gpu_step.py --smoke --out /tmp/kernels    # tiny models, CPU (script check)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

FAMILIES = (  # (family, substrings of a kernel name, lower case); the first that matches
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention")),
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "sm80_xmma", "cublas", "nvjet", "matmul", "wgmma", "mm_", "addmm", "::mm", "bmm")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("triton_fused", ("triton_",)),
    ("cast_copy", ("copy", "cast", "to_copy", "convert")),
    ("reduction", ("reduce", "sum", "norm", "softmax", "cross_entropy", "nll", "log_softmax")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "fill", "gelu", "silu", "mul", "add")),
)


ANNOTATIONS = ("FSDP::", "Optimizer.", "ProfilerStep", "## ")
"""Names of ``record_function`` ranges that a profiler of torch 2.11 lists as device events beside their
kernels (on an H200, 2026-11-27: ``FSDP::pre_forward`` 1.1 ms per block, ``Optimizer.step#AdamW.step``
22.9 ms), left out so that the table sums kernels once."""


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def kernel_rows(prof: torch.profiler.profile, device_type: str) -> list[tuple[str, int, float]]:
    """``(name, calls, total_us)`` of the device's kernels (CPU operators on a CPU run), longest first."""
    rows = []
    for ev in prof.key_averages():
        if getattr(ev, "is_user_annotation", False) or ev.key.startswith(ANNOTATIONS):
            continue  # record_function ranges (FSDP's hooks, the optimizer step): they span kernels listed too
        if device_type == "cuda":
            total = getattr(ev, "self_device_time_total", None)
            if total is None:
                total = getattr(ev, "self_cuda_time_total", 0.0)
            if total <= 0 or ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:
            total = ev.self_cpu_time_total
            if total <= 0:
                continue
        rows.append((ev.key, ev.count, float(total)))
    return sorted(rows, key=lambda r: -r[2])


def main(argv: list[str] | None = None) -> int:
    import bench_gpu_step as bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("gpt", "llama", "both"), default="both")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--plan-time-limit", type=float, default=10.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("profile_gpu_step.py needs a CUDA GPU (--smoke: tiny models on the CPU)", file=sys.stderr)
        return 2
    import whalepy
    from whalepy import ClusterSpec

    bench._single_process_env()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    cluster = ClusterSpec.local(1) if cuda else ClusterSpec.local(1, device_type="CPU")
    os.makedirs(args.out, exist_ok=True)
    for name in (("gpt", "llama") if args.model == "both" else (args.model,)):
        model, vocab, seq = bench.build(name, args.smoke)
        data = bench.batches(vocab, seq, args.batch, args.warmup + 1)
        pm = whalepy.parallelize(model, cluster, example_inputs=(data[0][0][:1],), loss_fn=bench.loss_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), global_batch=args.batch,
                                 time_limit_s=args.plan_time_limit)
        del model
        for x, y in data[:-1]:
            pm.train_step(x, y)
        if cuda:
            torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            pm.train_step(*data[-1])
            if cuda:
                torch.cuda.synchronize()
        rows = kernel_rows(prof, device.type)
        fams: dict[str, float] = {}
        for k, _, t in rows:
            fams[family(k)] = fams.get(family(k), 0.0) + t
        with open(os.path.join(args.out, f"{name}_kernels.txt"), "w") as f:
            f.write(f"# {name}: compile={pm.plan.compile}, optimizer {pm.plan.optimizer_impl.value}, "
                    f"precision {pm.plan.precision.value}, device {torch.cuda.get_device_name(device) if cuda else 'CPU'}, "
                    f"torch {torch.__version__}\n# total_us\tcalls\tmean_us\tfamily\tname\n")
            for k, n, t in rows:
                f.write(f"{t:.1f}\t{n}\t{t / n:.1f}\t{family(k)}\t{k}\n")
        with open(os.path.join(args.out, f"{name}_summary.json"), "w") as f:
            json.dump({"model": name, "compile": pm.plan.compile, "optimizer": pm.plan.optimizer_impl.value,
                       "predicted_step_s": pm.plan.cost.step_time_s,
                       "kernel_total_us": sum(t for _, _, t in rows),
                       "families_us": dict(sorted(fams.items(), key=lambda kv: -kv[1]))}, f, indent=1)
        print(f"{name}: {len(rows)} kernels, {sum(t for _, _, t in rows) / 1e3:.1f} ms in all; "
              + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in sorted(fams.items(), key=lambda kv: -kv[1])), flush=True)
        del pm
        bench._free()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
