"""The same inputs give the same plan on an idle and on a loaded machine (issue 26, issue 27 item 5): the
search is limited by work (branch-and-bound nodes, HiGHS on one thread with a fixed seed), never by the
clock. And no solver output reaches stdout (HiGHS prints a banner from C++ when a process makes its first
solver instance): the loaded run is a fresh process whose stdout must stay empty."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from whalepy.planner import plan_from_profile
from whalepy.planner.synthetic import gpt_profile

# a mixed cluster: stage orders and batch shares, many ILPs; its node limit low enough that some stop at it
CLUSTER = {"network": {"bandwidth_gbps": 400}, "groups": [
    {"name": "a100", "gpu": "A100-80GB", "gpus_per_node": 8, "nodes": 1, "intra_node": "nvswitch",
     "cpu_memory_gb": 1024},
    {"name": "v100", "gpu": "V100-32GB", "gpus_per_node": 8, "nodes": 1, "intra_node": "nvlink2",
     "cpu_memory_gb": 512}]}
CASE = dict(model="gpt3-1.3b", global_batch=64, ilp_node_limit=20)

_PLAN = textwrap.dedent("""
    import json, sys
    from whalepy.hardware.cluster import ClusterSpec
    from whalepy.planner import plan_from_profile
    from whalepy.planner.synthetic import gpt_profile
    case, cluster = json.loads(sys.argv[1]), ClusterSpec.from_dict(json.loads(sys.argv[2]))
    plan = plan_from_profile(gpt_profile(case["model"]), cluster, global_batch=case["global_batch"],
                             ilp_node_limit=case["ilp_node_limit"])
    sys.stderr.write(plan.to_json())
""")

_BUSY = "while True: pass"


def _comparable(text: str) -> dict:
    """The plan's JSON less the one field that is a measurement of the run: the search's wall time."""
    data = json.loads(text)
    data["solver"].pop("solve_time_s")
    return data


def test_same_plan_on_a_loaded_machine_and_no_solver_output() -> None:
    from whalepy.hardware.cluster import ClusterSpec

    idle = plan_from_profile(gpt_profile(CASE["model"]), ClusterSpec.from_dict(CLUSTER),
                             global_batch=CASE["global_batch"], ilp_node_limit=CASE["ilp_node_limit"])
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(2)]
    try:
        run = subprocess.run([sys.executable, "-c", _PLAN, json.dumps(CASE), json.dumps(CLUSTER)],
                             capture_output=True, text=True, timeout=600)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == "", f"solver output on stdout: {run.stdout[:300]!r}"
    assert _comparable(run.stderr) == _comparable(idle.to_json())
