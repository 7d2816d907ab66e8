"""``whalepy calibrate``: measure the current device and write its device profile (versioned JSON).

What is measured (:mod:`whalepy.tools.calibrate_bench`): GEMM times across shapes, causal SDPA forward and
backward, memory-bound bandwidth, the host-side launch cost, AdamW step rates on the device and on the
CPU (for offload), host <-> device bandwidth pinned and pageable (CUDA), disk write/read (the NVMe
tier), and, under ``torchrun`` with more than one process, all-reduce / all-gather / reduce-scatter /
send-recv against message size. The GEMM model's parameters are fitted to the GEMM rows
(:func:`whalepy.cost_models.compute.fit_gemm`); the profile keeps the raw rows next to the fit.

The file is ``<device type>.json`` (catalog name, e.g. ``H100-SXM.json``, ``CPU.json``) in
``~/.cache/whalepy/device_profiles`` by default, where the cost model looks for it
(:func:`whalepy.cost_models.device_profiles.resolve_compute_profile`); ``$WHALEPY_DEVICE_PROFILES``
adds directories searched first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from whalepy.tools import calibrate_bench as bench
from whalepy.frontend.measure import local_device_type as _device_type
from whalepy.frontend.measure_checks import parse_device as _parse_device
from whalepy.errors import ArgumentError, WhalepyError
from whalepy.files import check_output, write_file
from whalepy.cost_models.compute import attention_flops, fit_gemm, peak_flops
from whalepy.cost_models.device_profiles import (
    ATTENTION_EFFICIENCY_AMPERE,
    MEMORY_BANDWIDTH_EFFICIENCY,
    NUM_SMS,
    PROFILE_VERSION,
    default_profile_dir,
    forget_resolved_profiles,
    profile_filename,
)
from whalepy.cost_models.devices import CATALOG, DeviceType, match_device_name

__all__ = ["calibrate", "derive_from_microbench"]


def _sizes(device: torch.device, quick: bool) -> dict[str, Any]:
    if device.type == "cpu":
        gemm = [(m, k, n) for m in (64, 256) for k, n in ((256, 256), (256, 1024), (1024, 256))] if quick else \
            [(m, k, n) for m in (256, 1024, 2048) for k, n in ((512, 512), (512, 2048), (2048, 512), (1024, 1024))]
        return dict(gemm=gemm, dtype=torch.float32, attn=[(1, 4, 128, 32)] if quick else [(2, 8, 512, 64)],
                    mem=1 << 22 if quick else 1 << 25, adam=1 << 20 if quick else 1 << 24, repeats=3 if quick else 5,
                    disk=16 << 20 if quick else 512 << 20, comm=[1 << 10, 1 << 16] if quick else [1 << s for s in range(10, 27, 4)])
    hs = (1024, 2048) if quick else (1024, 2048, 4096, 8192)
    ms = (2048,) if quick else (2048, 8192, 32768)
    gemm = [(m, k, n) for h in hs for m in ms for k, n in ((h, 3 * h), (h, 4 * h), (4 * h, h), (h, h))]
    return dict(gemm=gemm, dtype=torch.bfloat16, attn=[(4, 16, 2048, 128)] if quick else
                [(b, 16, s, 128) for b, s in ((8, 1024), (4, 2048), (1, 8192))],
                mem=1 << 26 if quick else 1 << 28, adam=1 << 24 if quick else 1 << 28, repeats=5 if quick else 20,
                disk=64 << 20 if quick else 2 << 30, comm=[1 << s for s in range(10, 31, 2 if not quick else 6)])


def calibrate(*, quick: bool = False, out: str | Path | None = None, device: str | None = None,
              disk_dir: str | None = None, progress: Any = None) -> Path:
    """Run the micro-benchmarks on ``device`` (default: the current CUDA device, else CPU), fit the
    compute model and write the profile JSON; returns its path. ``quick`` uses a few small shapes
    (seconds on a CPU)."""
    say = progress or (lambda _m: None)
    if disk_dir is not None and not (os.path.isdir(disk_dir) and os.access(disk_dir, os.W_OK | os.X_OK)):
        why = "is not a directory" if os.path.exists(disk_dir) else "does not exist"
        why = "is not writable" if os.path.isdir(disk_dir) else why
        raise ArgumentError(f"calibrate: disk_dir {disk_dir!r} {why}; give an existing writable directory on the "
                            "drive the NVMe tier will use (--disk-dir)")
    dev = _parse_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    row, reported = _device_type(dev)
    _writable_out(_out_path(out, row.name))  # before minutes of benchmarks
    sz = _sizes(dev, quick)
    precision = "bf16" if sz["dtype"] is torch.bfloat16 else "fp32"
    say(f"calibrating {reported} as {row.name} ({'quick' if quick else 'full'})")
    meas: dict[str, Any] = {}
    meas["matmul"] = bench.bench_gemm(dev, sz["dtype"], sz["gemm"], sz["repeats"])
    say(f"GEMM: {len(meas['matmul'])} shapes, best {max(r['tflops'] for r in meas['matmul']):.3g} TFLOP/s")
    meas["attention"] = bench.bench_attention(dev, sz["dtype"], sz["attn"], sz["repeats"])
    meas["memory"] = bench.bench_memory(dev, sz["mem"], sz["repeats"])
    launch = bench.bench_launch(dev)
    launch_bwd = bench.bench_backward_launch(dev)
    rates: dict[str, float] = {"launch_overhead_s": launch, "launch_backward_overhead_s": launch_bwd,
                               "adamw_device_s_per_1e9": bench.bench_adamw(dev, sz["adam"], 3, foreach=True) * 1e9 / sz["adam"],
                               "adamw_cpu_s_per_1e8": bench.bench_adamw(torch.device("cpu"), sz["adam"], 3,
                                                                        foreach=True) * 1e8 / sz["adam"],
                               # the kernel ZeRO-Offload's host optimizer steps with (cost_models/offload.py)
                               "adamw_cpu_fused_s_per_1e8": bench.bench_adamw(torch.device("cpu"), sz["adam"], 3,
                                                                              fused=True) * 1e8 / sz["adam"]}
    if dev.type == "cuda":
        rates["adamw_device_fused_s_per_1e9"] = bench.bench_adamw(dev, sz["adam"], 3, fused=True) * 1e9 / sz["adam"]
        rates.update(bench.bench_host_link(dev, sz["mem"], sz["repeats"]))
    rates.update(bench.bench_disk(sz["disk"], disk_dir))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        meas["collectives"] = bench.bench_collectives(dev, sz["comm"], sz["repeats"])
        meas["collectives_world_size"] = dist.get_world_size()
    bandwidth = max(meas["memory"]["copy_GBps"], meas["memory"]["add_GBps"]) * 1e9
    fit = fit_gemm(meas["matmul"], row, num_sms=NUM_SMS.get(row.name) if dev.type == "cuda" else None,
                   memory_bandwidth=bandwidth, precision=precision)
    fit.update(gemm_tile=[128, 256], num_sms=NUM_SMS.get(row.name) if dev.type == "cuda" else None,
               memory_bandwidth=bandwidth, attention_efficiency=_attention_efficiency(meas["attention"], row, precision),
               launch_overhead_s=launch, launch_backward_overhead_s=launch_bwd,
               gemm_floor_s=fit.pop("launch_overhead_s"))
    data = {"version": PROFILE_VERSION, "device_type": row.name, "device_name": reported,
            "torch": torch.__version__, "precision": precision, "quick": quick,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": f"whalepy calibrate{' --quick' if quick else ''} on {reported}",
            "fit": fit, "rates": rates, "measurements": meas}
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return _out_path(out, row.name)
    path = _writable_out(_out_path(out, row.name))
    write_file(path, json.dumps(data, indent=1) + "\n", what="calibrate --out")
    forget_resolved_profiles()
    say(f"wrote {path} (GEMM fit: e={fit['gemm_efficiency']:.3f}, k0={fit['gemm_k_overhead']:.0f}, "
        f"RMS log error {fit['rms_log_error']:.3f})")
    return path


def _out_path(out: str | Path | None, device_type: str) -> Path:
    """``out`` as a file when it ends in ``.json``, else as a directory for ``<device type>.json``."""
    if out is None:
        return default_profile_dir() / profile_filename(device_type)
    out = Path(out)
    return out if out.suffix == ".json" else out / profile_filename(device_type)


def _writable_out(path: Path, inputs: tuple[str | Path, ...] = ()) -> Path:
    """``path``, its directory made, if the profile can be written there: one line otherwise."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArgumentError(f"calibrate --out {path}: cannot create the directory {path.parent} ({e.strerror or e}); "
                            "give a writable place (--out DIR or FILE.json)") from None
    return check_output(path, inputs=inputs, what="calibrate --out")


def _attention_efficiency(rows: list[dict], device: DeviceType, precision: str) -> float:
    """Fraction of peak of causal SDPA, forward + backward (causal FLOPs, backward 2.5x forward)."""
    effs = []
    for r in rows:
        f = attention_flops(r["batch"] * r["heads"], r["seq"], r["seq"], r["head_dim"], r["head_dim"], True)
        effs.append(3.5 * f / r["fwd_bwd_s"] / peak_flops(device, precision))
    return statistics.median(effs)


_MICROBENCH_KEYS = ("device", "torch", "matmul_bf16", "block", "adamw_gpu_foreach_s_per_1e9",
                    "adamw_gpu_fused_s_per_1e9", "adamw_cpu_s_per_1e8", "h2d_GBps_pinned=True",
                    "d2h_GBps_pinned=True", "h2d_GBps_pinned=False", "d2h_GBps_pinned=False", "disk_write_GBps",
                    "disk_read_GBps")


def _read_microbench(path: str | Path) -> dict[str, Any]:
    """The microbench JSON at ``path``, with every key :func:`derive_from_microbench` reads: one line
    naming what is wrong otherwise (a missing file, another JSON such as a plan or a profile)."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ArgumentError(f"--from-microbench {path}: cannot read it ({e.strerror or e}); give the microbench "
                            "JSON (e.g. h100-sxm_microbench.json)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ArgumentError(f"--from-microbench {path}: not valid JSON ({str(e)[:80]}); give the microbench "
                            "JSON") from None
    missing = [k for k in _MICROBENCH_KEYS if k not in raw] if isinstance(raw, dict) else list(_MICROBENCH_KEYS)
    if missing:
        kind = " (it is a whalepy plan)" if isinstance(raw, dict) and "stages" in raw else (
            " (it is a device profile: use it as is)" if isinstance(raw, dict) and "fit" in raw else "")
        raise ArgumentError(f"--from-microbench {path}: not a microbench JSON{kind}: it lacks {missing[:3]} "
                            f"({len(missing)} keys in all); give the microbench file the GPU servers wrote")
    return raw


def derive_from_microbench(path: str | Path) -> dict[str, Any]:
    """The shipped H100-SXM profile, derived from ``h100-sxm_microbench.json`` (the calibration data
    the project was given): the ``matmul_bf16`` rows are fitted; the ``block`` rows are NOT used (they
    are held out to check the model); the other rates are copied. No attention or bandwidth
    measurement is in that file, so those two figures are the cited defaults."""
    raw = _read_microbench(path)
    row = match_device_name(raw["device"], 80 * 2**30)
    if row is None:
        raise WhalepyError(f"{path}: device {raw['device']!r} is not in the catalog")
    from whalepy.cost_models.device_profiles import ATTENTION_EFFICIENCY_HOPPER

    gemm = [{k: r[k] for k in ("m", "k", "n", "s")} for r in raw["matmul_bf16"]]
    bandwidth = row.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY
    fit = fit_gemm(gemm, row, num_sms=NUM_SMS[row.name], memory_bandwidth=bandwidth)
    fit.update(gemm_tile=[128, 256], num_sms=NUM_SMS[row.name], memory_bandwidth=bandwidth,
               attention_efficiency=ATTENTION_EFFICIENCY_HOPPER if row.name.startswith("H") else
               ATTENTION_EFFICIENCY_AMPERE, gemm_floor_s=fit["launch_overhead_s"])
    rates = {"adamw_device_s_per_1e9": raw["adamw_gpu_foreach_s_per_1e9"],
             "adamw_device_fused_s_per_1e9": raw["adamw_gpu_fused_s_per_1e9"],
             "adamw_cpu_s_per_1e8": raw["adamw_cpu_s_per_1e8"],
             "h2d_pinned_GBps": raw["h2d_GBps_pinned=True"], "d2h_pinned_GBps": raw["d2h_GBps_pinned=True"],
             "h2d_pageable_GBps": raw["h2d_GBps_pinned=False"], "d2h_pageable_GBps": raw["d2h_GBps_pinned=False"],
             "disk_write_GBps": raw["disk_write_GBps"], "disk_read_GBps": raw["disk_read_GBps"]}
    return {"version": PROFILE_VERSION, "device_type": row.name, "device_name": raw["device"], "torch": raw["torch"],
            "precision": "bf16",
            "source": "h100-sxm_microbench.json (one H100 80GB HBM3 SXM, torch 2.11.0+cu130, measured 2026-11-22); "
                      "GEMM model fitted to its matmul_bf16 rows",
            "sources": {
                "gemm_efficiency, gemm_k_overhead, launch_overhead_s": "fit_gemm over the 48 matmul_bf16 rows",
                "memory_bandwidth": "no measurement: datasheet 3,350 GB/s x MEMORY_BANDWIDTH_EFFICIENCY (BabelStream)",
                "attention_efficiency": "no measurement: ATTENTION_EFFICIENCY_HOPPER (FlashAttention-3 paper on FA2)",
                "rates": "copied from the file (AdamW, host link, disk)",
                "block_held_out": "the file's GPT-block rows, NOT used by the fit: kept to check the model "
                                  "(tests/test_cost_shapes.py)"},
            "fit": fit, "rates": rates,
            "measurements": {"matmul": gemm, "block_held_out": [
                {k: r[k] for k in ("h", "seq", "mb", "mode", "fwd_s", "fwd_bwd_s")} for r in raw["block"]]}}


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``whalepy calibrate`` (its arguments: ``whalepy.tools.cli._add_calibrate``, which imports this module only
    when the command runs: torch takes seconds to import, ``--help`` must not wait for it)."""
    import sys

    def say(m: str) -> None:
        print(f"[whalepy] {m}", file=sys.stderr, flush=True)

    for flag, given in (("--table-model", args.table_model), ("--device-type", args.device_type)):
        if given and not args.import_file:
            raise ArgumentError(f"{flag} applies with --import FILE (a per-layer table) only; add --import, or drop {flag}")
    if args.precision is not None and not args.model:
        raise ArgumentError("--precision applies with --model MODULE:FN only (the blocks measured); add --model, or "
                            "drop --precision")
    if args.import_file or args.model:
        return _cmd_measured(args, say)
    if args.from_microbench:
        data = derive_from_microbench(args.from_microbench)
        path = _writable_out(_out_path(args.out, data["device_type"]), inputs=(args.from_microbench,))
        write_file(path, json.dumps(data, indent=1) + "\n", what="calibrate --out")
        say(f"wrote {path}")
        print(path)
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    path = calibrate(quick=args.quick, out=args.out, device=args.device, disk_dir=args.disk_dir, progress=say)
    print(path)
    return 0


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise ArgumentError(f"{flag} {text!r}: give positive integers separated by commas, e.g. {flag} 1,2,4")
    return vals


def _cmd_measured(args: argparse.Namespace, say: Any) -> int:
    """``--model`` (measure here) and ``--import`` (a per-layer table): the device profiles' ``measured``
    sections (:mod:`whalepy.tools.measured_files`)."""
    from whalepy.tools.measured_files import import_layer_table, load_model_fn, write_measured
    from whalepy.frontend.profile import profile

    if args.model is None:
        raise ArgumentError("--import needs --model MODULE:FN: the model the table was measured on, whose blocks "
                            "its layers are bound to")
    if args.import_file:  # --out checked before the work: the table's device types are known only then
        if args.out is not None:
            _writable_out(_out_path(args.out, "device"), inputs=(args.import_file,))
    else:
        dev = _parse_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        micro_batches, tp_degrees = _ints(args.micro_batches, "--micro-batches"), _ints(args.tp_degrees, "--tp-degrees")
        out = _writable_out(_out_path(args.out, _device_type(dev)[0].name))
    model, inputs = load_model_fn(args.model)
    if args.import_file:
        names = {}
        for item in args.device_type:
            k, sep, v = item.partition("=")
            if not sep or not k or not v:
                raise ArgumentError(f"--device-type {item!r}: give TABLE_NAME=TYPE, e.g. --device-type GH-96=GH200")
            names[k] = v
        prof = profile(model, inputs)
        for m in import_layer_table(args.import_file, prof, table_model=args.table_model, device_types=names):
            path = write_measured(m, _out_path(args.out, m.device_type))
            say(f"imported {len(m.times)} distinct blocks of {m.device_name} as {m.device_type}: {path}")
            print(path)
        return 0
    precision = args.precision or ("bf16" if dev.type == "cuda" else "fp32")
    prof = profile(model, inputs, measure=True, device=dev, precision=precision, micro_batches=micro_batches,
                   tp_degrees=tp_degrees)
    m = prof.measured
    path = write_measured(m, out)
    say(f"measured {len(m.times)} distinct blocks of {type(model).__name__} on {m.device_name}: {path}")
    print(path)
    return 0
