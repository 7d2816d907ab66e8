"""The ``whalepy`` console script: ``plan``, ``show``, ``estimate``, ``study zero`` (whalepy.tools.study),
``calibrate`` (whalepy.tools.calibrate), ``check`` (whalepy.tools.rank_check),
``export`` and ``run`` (whalepy.tools.launch).

Errors whalepy raises on purpose print as one line and exit with code 2, without a traceback. Each
subcommand's module is imported only when it runs (``COMMANDS``); output piped into ``head`` ends
quietly with exit code 141. The console script is :func:`entry`: :func:`main` in a process of its own,
with the garbage collector set for a short-lived process and no interpreter teardown at its end.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from whalepy.errors import WhalepyError
from whalepy.tools.model_arg import DEFAULT_SAMPLES_PER_DEVICE, default_global_batch, load_model, published_batches_text

EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE, what a shell reports for a command whose reader closed the pipe."""


def _err(msg: str) -> None:
    print(f"[whalepy] {msg}", file=sys.stderr, flush=True)


def _profile(args: argparse.Namespace, progress) -> tuple[Any, bool | None]:  # type: ignore[no-untyped-def]
    """The model's profile, and what it learned of ``torch._dynamo.is_dynamo_supported()`` (None: nothing).
    A built-in model's profile is read from the stored profiles when every input is the same
    (:mod:`whalepy.tools.profile_cache`; ``--no-cache``: neither read nor written)."""
    from whalepy.ir.profile import ModelProfile

    builtin = ":" not in args.model  # a plan of the built-in gpt3-175b is titled gpt3-175b, not by its class
    key = None
    if builtin and not getattr(args, "no_cache", False):
        from whalepy.tools import profile_cache

        key = profile_cache.cache_key(args.model, batch=1, seq_len=args.seq_len)
        entry = profile_cache.load_stored(key, _err)
        if entry is not None:
            progress(f"read the stored profile of {args.model} ({profile_cache.cache_path(key)})")
            return entry.profile, entry.dynamo_supported
    loaded = load_model(args.model, batch=1, seq_len=args.seq_len)
    if isinstance(loaded, ModelProfile):
        return loaded, None
    from whalepy.frontend.profile import profile

    model, inputs = loaded
    progress(f"capturing {args.model}")
    t0 = time.perf_counter()
    prof = profile(model, inputs, model_name=args.model.strip().lower() if builtin else None)
    progress(f"captured {len(prof.blocks)} blocks in {time.perf_counter() - t0:.2f} s")
    if key is not None:
        entry = profile_cache.store(key, prof, _err)
        return prof, entry.dynamo_supported
    dynamo = sys.modules.get("torch._dynamo")
    return prof, (bool(dynamo.is_dynamo_supported()) if dynamo else None)


def _cluster(path: str):  # type: ignore[no-untyped-def]
    from whalepy.hardware.cluster import ClusterSpec

    return ClusterSpec.load(path)


def cmd_plan(args: argparse.Namespace) -> int:
    from whalepy.planner import plan_from_profile

    progress = _err if not args.quiet else (lambda _m: None)
    cluster = _cluster(args.cluster)
    margin = _margin_value(args.memory_margin)  # before the capture
    prof, dynamo_supported = _profile(args, progress)
    opts: dict[str, Any] = dict(solver=args.solver, time_limit_s=args.time_limit, progress=progress,
                                precision=args.precision)
    if args.ilp_node_limit is not None:
        opts["ilp_node_limit"] = args.ilp_node_limit
    if args.schedules:
        opts["schedules"] = tuple(args.schedules.split(","))
    if args.zero_stages:
        opts["zero_stages"] = tuple(int(z) for z in args.zero_stages.split(","))
    if args.no_checkpointing:
        opts["allow_checkpointing"] = False
    if args.no_offload:
        opts["allow_offload"] = False
    if args.no_activation_offload:
        opts["allow_activation_offload"] = False
    if args.checkpoint_offload:
        opts["allow_checkpoint_offload"] = True
    if args.one_tier_per_stage:
        opts["mixed_tiers"] = False
    if args.max_tp:
        opts["max_tp"] = args.max_tp
    if margin is not None:
        opts["memory_margin"] = margin
    if args.baseline:
        opts["homogeneous_baseline"] = True
    opts.update(_impl_options(args, cluster, dynamo_supported))
    plan = plan_from_profile(prof, cluster, global_batch=args.global_batch, **opts)
    print(plan.summary(batch_source=getattr(args, "batch_source", None)))
    if args.explain:
        from whalepy.ir.profile_text import format_plan_tp_report

        print(plan.explain())
        print("Tensor parallelism per block (rule per module; modules left whole, and why):")
        print(format_plan_tp_report(plan, prof))
    if args.out:
        plan.save(args.out)
        progress(f"wrote {args.out}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from whalepy.ir.plan import Plan

    plan = Plan.load(args.plan)
    if args.check:
        check_plan_cli(plan, args)
    if args.html or args.svg:
        from whalepy.tools.show import plan_html, plan_timeline_svg, write_text

        for path, render in ((args.html, plan_html), (args.svg, plan_timeline_svg)):
            if path:
                write_text(path, render(plan), inputs=(args.plan,), what=f"--{render.__name__.split('_')[-1]}")
                _err(f"wrote {path}")
        if not args.explain:
            return 0
    print(plan)
    if args.explain:
        print(plan.explain())
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from whalepy.tools.show import plan_diff
    from whalepy.ir.plan import Plan

    print(plan_diff(Plan.load(args.first), Plan.load(args.second)))
    return 0


def check_plan_cli(plan: Any, args: argparse.Namespace) -> None:
    """``whalepy show --check``: stale costs, and with ``--model`` the plan against that model."""
    from whalepy.planner.check import check_costs

    check_costs(plan)
    if args.model:
        from whalepy.ir.profile import ModelProfile

        loaded = load_model(args.model, batch=1, seq_len=args.seq_len or plan.seq_len)
        if isinstance(loaded, ModelProfile):
            plan.check_against(profile=loaded)
        else:
            plan.check_against(loaded[0], example_inputs=loaded[1])
    _err(f"checked {args.plan}: {'consistent with ' + args.model if args.model else 'costs up to date'}")


def cmd_estimate(args: argparse.Namespace) -> int:
    from whalepy.planner.estimate import ParallelConfig, check_config_on_cluster, estimate_from_profile

    progress = _err if not args.quiet else (lambda _m: None)
    cluster = _cluster(args.cluster)
    margin = _margin_value(args.memory_margin)  # before the capture
    cfg = ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, num_microbatches=args.microbatches,
                         schedule=args.schedule, zero_stage=args.zero, checkpoint=args.checkpoint,
                         offload=args.offload)
    check_config_on_cluster(cfg, cluster, args.global_batch, args.precision)  # before the capture, too
    prof, dynamo_supported = _profile(args, progress)
    est = estimate_from_profile(prof, cluster, cfg, global_batch=args.global_batch, precision=args.precision,
                                **({} if margin is None else {"memory_margin": margin}),
                                **_impl_options(args, cluster, dynamo_supported))
    print(est)
    if getattr(args, "batch_source", None):
        print(f"  global batch {args.global_batch} ({args.batch_source})")
    return 0 if est.feasible else 1


def _margin_value(text: str | None):  # type: ignore[no-untyped-def]
    """``--memory-margin`` as a MemoryMargin (None when not given); a bad one fails here, before the capture."""
    from whalepy.planner.margin import parse_memory_margin

    if text is None:
        return None
    try:
        value: Any = float(text)
    except ValueError:
        value = text
    return parse_memory_margin(value, "--memory-margin")


def cmd_study_zero(args: argparse.Namespace) -> int:
    from whalepy.tools.study_format import format_zero_study, plot_zero_study, write_zero_study_csv
    from whalepy.tools.study import study_zero

    progress = _err if not args.quiet else (lambda _m: None)
    models = [m for m in ([args.model] if args.model else []) + (args.sizes.split(",") if args.sizes else []) if m]
    rows = study_zero(models, _cluster(args.cluster), global_batch=args.global_batch, seq_len=args.seq_len,
                      num_microbatches=args.microbatches, checkpoint=args.checkpoint, precision=args.precision,
                      offload=not args.no_offload, measure=args.measure, progress=progress)
    print(format_zero_study(rows))
    if args.csv:
        write_zero_study_csv(rows, args.csv)
        progress(f"wrote {args.csv}")
    if args.plot:
        plot_zero_study(rows, args.plot)
        progress(f"wrote {args.plot}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from whalepy.tools.export import export_safetensors

    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    files = export_safetensors(args.checkpoint, args.to, config=args.config,
                               max_shard_size=args.max_shard_size, dtype=dtype)
    if not args.quiet:
        _err(f"wrote {len(files)} safetensors file(s) and config.json to {args.to}")
    return 0


def _model_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("model", help="built-in name (gpt2, llama3-8b, ...), package.module:function returning "
                                  "(model, example_inputs), or synthetic:NAME")
    sp.add_argument("--cluster", required=True, help="cluster spec (YAML or JSON)")
    sp.add_argument("--global-batch", type=int, default=None, help=(
        "samples per step (default: a built-in model's published training batch at its published sequence length: "
        + published_batches_text() + "; otherwise 8 per device, as for llama3-8b and t5-v1_1-*, which have none "
        "published)"))
    sp.add_argument("--seq-len", type=int, default=None, help="tokens per sample (built-in models)")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    sp.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                    help="training precision (default: bf16 where every device supports it, fp16 on "
                         "V100/T4-class GPUs, fp32 on CPU device types)")
    sp.add_argument("--no-cache", action="store_true",
                    help="capture a built-in model again, neither reading nor writing its stored profile "
                         "(default: stored in ~/.cache/whalepy/profiles, or $WHALEPY_PROFILE_CACHE)")


_COMPILE = {"auto": "auto", "on": True, "off": False}
"""``--compile``'s words and the ``PlannerOptions.compile`` values they give."""


def _impl_options(args: argparse.Namespace, cluster: Any, dynamo_supported: bool | None) -> dict[str, Any]:
    """``--optimizer-impl`` and ``--compile`` as ``PlannerOptions`` fields; ``--compile auto`` resolved here
    where the profile step knows dynamo's answer (a stored profile: the planner then needs no torch)."""
    compile_: bool | str = _COMPILE[args.compile]
    if compile_ == "auto" and dynamo_supported is not None:
        from whalepy.planner import resolve_compile

        compile_ = resolve_compile(cluster, "auto", dynamo_supported=dynamo_supported)
    return dict(optimizer_impl=args.optimizer_impl, compile=compile_)


def _impl_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--optimizer-impl", choices=("auto", "fused", "as_given"), default="auto",
                    help="optimizer the runtime lowers and the cost model charges: fused (torch's fused kernel of "
                         "the same algorithm), as_given (the factory's exactly), auto (default: fused where torch "
                         "has fused kernels for every device type of the cluster)")
    sp.add_argument("--compile", choices=tuple(_COMPILE), default="auto",
                    help="compile each block with torch.compile: on, off, auto (default: on where every group "
                         "runs on CUDA GPUs, off on CPU)")


def _add_plan(sub: Any) -> None:
    sp = sub.add_parser("plan", help=COMMANDS["plan"].help)
    _model_args(sp)
    sp.add_argument("--out", help="write the plan as JSON")
    sp.add_argument("--solver", default="highs", choices=("highs", "cbc", "exhaustive"),
                    help="ILP solver (default highs; cbc through pulp; exhaustive: every candidate, small cases)")
    sp.add_argument("--time-limit", type=float, default=None,
                    help="wall-clock limit of the search in seconds (default: none; the search is limited by work, "
                    "so the same inputs give the same plan on any load)")
    sp.add_argument("--ilp-node-limit", type=int, default=None,
                    help="work limit of one candidate's ILP in branch-and-bound nodes (default 250); raise it "
                    "to close a proven gap the plan states")
    sp.add_argument("--schedules", help="comma-separated: gpipe,1f1b,interleaved_1f1b")
    sp.add_argument("--zero-stages", help="comma-separated ZeRO stages to consider, e.g. 0,1,2,3")
    sp.add_argument("--no-checkpointing", action="store_true", help="never recompute activations "
                    "(allow_checkpointing=False)")
    sp.add_argument("--no-offload", action="store_true", help="keep parameters and optimizer states on the "
                    "devices (no cpu / nvme tiers)")
    sp.add_argument("--no-activation-offload", action="store_true",
                    help="never keep activations in host memory (allow_activation_offload=False)")
    sp.add_argument("--checkpoint-offload", action="store_true",
                    help="may keep activation checkpoints in host memory (allow_checkpoint_offload=True)")
    sp.add_argument("--one-tier-per-stage", action="store_true",
                    help="give all blocks of a stage one (param, optimizer) tier pair (mixed_tiers=False)")
    sp.add_argument("--max-tp", type=int, help="largest tensor-parallel degree to consider")
    _margin_arg(sp)
    sp.add_argument("--baseline", action="store_true", help="homogeneous-slowest baseline instead")
    sp.add_argument("--explain", action="store_true", help="also list the alternatives and why they lost")
    _impl_args(sp)
    sp.set_defaults(func=cmd_plan)


def _add_show(sub: Any) -> None:
    sp = sub.add_parser("show", help=COMMANDS["show"].help)
    sp.add_argument("plan", help="plan JSON written by `whalepy plan --out`")
    sp.add_argument("--explain", action="store_true", help="also list the alternatives and why they lost")
    sp.add_argument("--html", metavar="PATH", help="write a self-contained page: devices, memory, pipeline "
                                                   "timeline, GPU types, alternatives (docs/show.md)")
    sp.add_argument("--svg", metavar="PATH", help="write the pipeline timeline alone as SVG")
    sp.add_argument("--check", action="store_true", help="validate the plan (stale costs; with --model, "
                    "blocks, TP rules and annotations against the model); exit 2 on a problem")
    sp.add_argument("--model", help="with --check: the model the plan is for (as for `whalepy plan`)")
    sp.add_argument("--seq-len", type=int, default=None, help="with --model: tokens per sample (built-in)")
    sp.set_defaults(func=cmd_show)


def _add_diff(sub: Any) -> None:
    sp = sub.add_parser("diff", help=COMMANDS["diff"].help)
    sp.add_argument("first", help="the plan JSON to compare from")
    sp.add_argument("second", help="the plan JSON to compare to")
    sp.set_defaults(func=cmd_diff)

def _add_estimate(sub: Any) -> None:
    sp = sub.add_parser("estimate", help=COMMANDS["estimate"].help)
    _model_args(sp)
    sp.add_argument("--dp", type=int, required=True, help="data-parallel degree (replicas)")
    sp.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    sp.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    sp.add_argument("--microbatches", type=int, default=1, help="micro-batches per step (default 1)")
    sp.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b or interleaved_1f1b "
                                                      "(default 1f1b)")
    sp.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 (default 0)")
    sp.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    sp.add_argument("--offload", choices=("cpu", "nvme"), help="cpu: parameters, gradients and optimizer "
                    "states on the host (FSDP2 CPUOffloadPolicy); nvme: optimizer states in files")
    _margin_arg(sp)
    _impl_args(sp)
    sp.set_defaults(func=cmd_estimate)


def _margin_arg(sp: Any) -> None:
    sp.add_argument("--memory-margin", default=None, metavar="M",
                    help="device memory left unplanned beside the reserve: a fraction (0.05, the default), a "
                    "percentage (5%%) or GiB per device (4GiB); 0 plans to the usable limit (memory_margin)")


def _add_study(sub: Any) -> None:
    sp = sub.add_parser("study", help=COMMANDS["study"].help)
    studies = sp.add_subparsers(dest="study", required=True)
    sp = studies.add_parser("zero", help="memory, communication and throughput of ZeRO stages 0-3 (and "
                                         "offload) per model size")
    sp.add_argument("model", nargs="?", default=None, help="built-in name, package.module:function, or "
                                                          "synthetic:NAME (optional with --sizes)")
    sp.add_argument("--cluster", required=True, help="cluster spec (YAML or JSON)")
    sp.add_argument("--sizes", help="comma-separated built-in models or families: mt5 (mt5-base ... "
                                    "mt5-xxl), t5 (t5-v1_1-xl, t5-v1_1-xxl)")
    sp.add_argument("--global-batch", type=int, default=None, help="samples per step (default 8 per device)")
    sp.add_argument("--seq-len", type=int, default=None, help="tokens per sample (built-in models)")
    sp.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation micro-batches")
    sp.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    sp.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                    help="training precision (default as for `whalepy plan`)")
    sp.add_argument("--no-offload", action="store_true", help="leave out the CPU-offload rows")
    sp.add_argument("--measure", action="store_true", help="also train each row a few steps on CPU gloo "
                                                           "processes and show measured bytes (small models)")
    sp.add_argument("--csv", help="write the rows as CSV")
    sp.add_argument("--plot", help="write a plot image (needs matplotlib: whalepy[plot])")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    sp.set_defaults(func=cmd_study_zero)


def _add_export(sub: Any) -> None:
    sp = sub.add_parser("export", help=COMMANDS["export"].help)
    sp.add_argument("checkpoint", help="DCP directory written by ParallelModel.save (under any plan)")
    sp.add_argument("--to", required=True, help="output directory (loadable with from_pretrained)")
    sp.add_argument("--config", help="the model's HF config.json (default: the one in the checkpoint)")
    sp.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB")
    sp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    help="convert floating-point weights (default: as stored)")
    sp.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
    sp.set_defaults(func=cmd_export)


def _add_calibrate(sub: Any) -> None:
    from whalepy.cost_models.device_profiles import default_profile_dir

    sp = sub.add_parser("calibrate", help=COMMANDS["calibrate"].help)
    sp.add_argument("--quick", action="store_true", help="a few small shapes: seconds on a CPU (for CI)")
    sp.add_argument("--out", help=f"a .json file, or a directory for <device type>.json (default {default_profile_dir()})")
    sp.add_argument("--device", help="torch device, e.g. cuda:1 or cpu (default: cuda if available)")
    sp.add_argument("--disk-dir", help="directory on the NVMe tier for the disk benchmark (default: temp dir)")
    sp.add_argument("--from-microbench", help="derive a profile from a microbench JSON instead of measuring")
    sp.add_argument("--model", metavar="MODULE:FN",
                    help="measure this model's distinct blocks here (FN() returns (model, example_inputs)) and add "
                         "them to the device profile's 'measured' section; with --import: the model the table is of")
    sp.add_argument("--micro-batches", default="1,2,4", help="with --model: micro-batch sizes to time (default 1,2,4)")
    sp.add_argument("--tp-degrees", default="1,2", help="with --model: tensor-parallel degrees to time (default 1,2)")
    sp.add_argument("--precision", default=None, help="with --model: fp32, bf16 or fp16 (default bf16 on a GPU, "
                                                      "fp32 on the CPU)")
    sp.add_argument("--import", dest="import_file", metavar="FILE",
                    help="import a per-layer table (forward/backward/update seconds per layer, micro-batch and TP "
                         "degree; docs/profiling.md) as device profiles, one per GPU in it; needs --model")
    sp.add_argument("--table-model", help="with --import: the table's model name (when it holds several)")
    sp.add_argument("--device-type", action="append", default=[], metavar="TABLE_NAME=TYPE",
                    help="with --import: file a table GPU under this device type name (repeatable)")
    sp.set_defaults(func=lambda args: importlib.import_module("whalepy.tools.calibrate").cmd_calibrate(args))


@dataclass(frozen=True, slots=True)
class Command:
    help: str
    """One line for ``whalepy --help``."""
    register: str
    """``module:function`` that adds the subcommand to an argparse sub-parser set (``add_parser(name,
    ...)``, its arguments, ``set_defaults(func=handler)``); imported only when that subcommand runs, so
    ``whalepy --help`` imports neither torch nor the planner."""


COMMANDS: dict[str, Command] = {
    "plan": Command("find the fastest plan that fits", "whalepy.tools.cli:_add_plan"),
    "show": Command("print a saved plan", "whalepy.tools.cli:_add_show"),
    "diff": Command("what changed between two saved plans, and the predicted effect", "whalepy.tools.cli:_add_diff"),
    "estimate": Command("predict one configuration", "whalepy.tools.cli:_add_estimate"),
    "study": Command("studies of a model on a cluster (zero: the ZeRO-stage trade-off)",
                     "whalepy.tools.cli:_add_study"),
    "calibrate": Command("measure this device and write its device profile (JSON)",
                         "whalepy.tools.cli:_add_calibrate"),
    "check": Command("lower every rank role of a plan in one process (fake process group, meta model) and "
                     "compare what each rank holds with the plan", "whalepy.tools.rank_check:add_check_subparser"),
    "export": Command("write a checkpoint's weights as HF safetensors", "whalepy.tools.cli:_add_export"),
    "run": Command("launch a training script on N processes (a thin wrapper over torchrun)",
                   "whalepy.tools.launch:add_run_subparser"),
}
"""The subcommands, in the order ``--help`` lists them. Adding one is one entry here plus its
registering function."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with every subcommand's arguments when ``command`` is None, else with only those of
    ``command`` (the others listed by name and help)."""
    from whalepy import __version__

    p = argparse.ArgumentParser(prog="whalepy", description="Plan hybrid-parallel training of a PyTorch model.")
    p.add_argument("--version", action="version", version=f"whalepy {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, c in COMMANDS.items():
        if command is None or name == command:
            mod_name, fn_name = c.register.split(":")
            getattr(importlib.import_module(mod_name), fn_name)(sub)
        else:
            sub.add_parser(name, help=c.help)
    return p


def _command_in(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first non-option word), if it is one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _quiet_broken_pipe() -> int:
    """stdout's reader went away (``whalepy plan ... | head``): stop without a traceback, and point
    stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    from whalepy.tools.cli_args import one_line_usage_errors

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_in(argv) or "")
    one_line_usage_errors(parser)
    args = parser.parse_args(argv)
    try:
        from whalepy.tools.cli_args import check_cli_args

        check_cli_args(args)
        if getattr(args, "global_batch", "absent") is None:
            from whalepy.hardware.cluster import ClusterSpec

            world = ClusterSpec.load(args.cluster).world_size
            if args.command in ("plan", "estimate"):
                args.global_batch, args.batch_source = default_global_batch(args.model, args.seq_len, world)
            else:
                args.global_batch = DEFAULT_SAMPLES_PER_DEVICE * world
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except WhalepyError as e:
        source = getattr(args, "batch_source", None)
        # an error about a batch the user did not give says where it came from
        _err(f"error: {e}" + (f" ({args.global_batch} is the default: {source})"
                               if source and "global batch" in str(e) else ""))
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


GC_THRESHOLDS = (10_000, 100, 100)
"""NAMED CONSTANT: the cyclic garbage collector's thresholds in the ``whalepy`` process (:func:`entry`;
CPython's defaults are 700, 10, 10). Importing torch and capturing a model allocate many objects that
live to the end, and at the defaults the collector ran 1,116 times in `whalepy plan gpt3-175b --cluster
examples/clusters/a100_128x8.yaml`, 7 of them full collections over every object: 0.87-0.99 s of its 7 s
of CPU; at (10,000, 10, 10) 74 times, none full, 0.35-0.38 s; at these, 74 times, the older generation
examined less often, 0.14-0.16 s (docs/benchmarks.md, "The CLI's time (issue 26, session 15)"). What waits
longer to be collected is only garbage in reference cycles: the peak memory grew by 4 MB (375 to 379 MB
in process). Only the console script sets them: :func:`main` called in a caller's process leaves its
collector alone."""


def entry() -> NoReturn:
    """The ``whalepy`` console script (and ``python -m whalepy.tools.cli``): :func:`main` in a process of
    its own, with the collector's :data:`GC_THRESHOLDS`, ended by :func:`_exit_without_teardown`."""
    gc.set_threshold(*GC_THRESHOLDS)
    _exit_without_teardown(main())


def _exit_without_teardown(code: int) -> NoReturn:
    """Exit with ``code`` as ``sys.exit`` would, less the interpreter's teardown: output flushed, the
    ``atexit`` handlers run (logging's flush among them), then ``os._exit``. Tearing down the modules of a
    process that imported torch took 0.8-1.0 s of CPU for nothing (the process ends). Where a thread
    that is not a daemon still runs, the ordinary exit instead (it waits for the thread)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = _quiet_broken_pipe()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader gone, or a stream an atexit handler closed
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
