"""``whalepy run``: a thin wrapper over ``torchrun`` (``python -m torch.distributed.run``).

``whalepy run -n 4 train.py --lr 1e-3`` is ``torchrun --standalone --nproc-per-node 4 train.py --lr
1e-3``. With ``--nnodes > 1`` the rendezvous flags are passed through instead of ``--standalone``.
``--plan plan.json`` exports ``WHALEPY_PLAN=plan.json``; ``whalepy.parallelize`` then uses that plan
instead of planning (a plan passed explicitly still wins).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

__all__ = ["add_run_subparser", "build_torchrun_command", "main_run"]

PLAN_ENV = "WHALEPY_PLAN"


def add_run_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``run`` on an ``argparse`` sub-parser set; the handler is ``args.func = main_run``."""
    p = subparsers.add_parser(
        "run",
        help="launch a training script on N processes (a thin wrapper over torchrun)",
        description="Launch SCRIPT on N local processes per node with torchrun; every process runs "
        "SCRIPT, and whalepy.parallelize() inside it lowers the plan for that process's rank.",
    )
    p.add_argument("-n", "--nproc-per-node", dest="nproc_per_node", required=True,
                   help="processes per node (an integer, or 'gpu' / 'cpu' / 'auto' as torchrun takes)")
    p.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX (default 1)")
    p.add_argument("--node-rank", dest="node_rank", type=int, default=None,
                   help="this node's rank (static rendezvous)")
    p.add_argument("--master-addr", dest="master_addr", default=None,
                   help="address of node 0 for the static rendezvous (torchrun's --master-addr)")
    p.add_argument("--master-port", dest="master_port", type=int, default=None,
                   help="free port on node 0 for the static rendezvous (torchrun's --master-port)")
    p.add_argument("--rdzv-endpoint", dest="rdzv_endpoint", default=None,
                   help="host:port of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-id", dest="rdzv_id", default=None,
                   help="job id shared by every node's launch with --rdzv-endpoint (torchrun's --rdzv-id)")
    p.add_argument("--plan", default=None, help="plan JSON to use instead of planning (sets "
                   f"{PLAN_ENV})")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="print the torchrun command and exit")
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=main_run)
    return p


def build_torchrun_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc_per_node)]
    if str(args.nnodes) == "1" and args.rdzv_endpoint is None and args.master_addr is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(args.nnodes)]
        if args.node_rank is not None:
            cmd += ["--node-rank", str(args.node_rank)]
        if args.master_addr is not None:
            cmd += ["--master-addr", args.master_addr]
        if args.master_port is not None:
            cmd += ["--master-port", str(args.master_port)]
        if args.rdzv_endpoint is not None:
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
        if args.rdzv_id is not None:
            cmd += ["--rdzv-id", str(args.rdzv_id)]
    if str(args.nnodes) == "1" and args.master_port is not None and "--standalone" not in cmd:
        cmd += ["--master-port", str(args.master_port)]
    return [*cmd, args.script, *args.script_args]


def _check_plan_for_launch(args: argparse.Namespace) -> None:
    """``--plan``: a readable plan (one line here, not one failure per rank) made for as many processes as
    the launch starts, when ``-n`` and ``--nnodes`` are plain counts."""
    from whalepy.errors import LaunchError
    from whalepy.ir.plan import Plan

    plan = Plan.load(args.plan)
    n, nodes = str(args.nproc_per_node), str(args.nnodes)
    if n.isdigit() and nodes.isdigit() and int(n) * int(nodes) != plan.world_size:
        per_node, whole = divmod(plan.world_size, int(nodes))
        fix = f"-n {per_node}" if not whole and per_node else f"a launch of {plan.world_size} processes"
        raise LaunchError(f"-n {n}{f' on {nodes} nodes' if nodes != '1' else ''} starts {int(n) * int(nodes)} "
                          f"processes but the plan {args.plan} is for {plan.world_size}; use {fix}, or re-plan "
                          "for this launch")


def main_run(args: argparse.Namespace) -> int:
    """Run torchrun; return its exit status."""
    if not os.path.exists(args.script):
        print(f"whalepy run: no script at {args.script}", file=sys.stderr)
        return 2
    cmd = build_torchrun_command(args)
    env = dict(os.environ)
    if args.plan is not None:
        _check_plan_for_launch(args)
        env[PLAN_ENV] = os.path.abspath(args.plan)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    try:
        # the same torchrun, through whalepy.tools.torchrun: a failed rank ends in one line, not torchrun's report
        return subprocess.call([cmd[0], "-m", "whalepy.tools.torchrun", *cmd[3:]], env=env)
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="whalepy")
    add_run_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
