"""Every user mistake in the Python API is one whalepy error line naming the cause and the fix, raised
before any capture or planning where the arguments alone show it (issue 12, deliver 4).

One case per mistake: annotations, cluster specs, planner and estimator arguments, the runtime's
arguments outside a launch. Plan files and the command line are in test_bad_inputs_files.py; a mistake
inside a real torchrun launch in test_bad_inputs_launch.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import whalepy
from whalepy import (
    AnnotationError,
    ArgumentError,
    CaptureError,
    ClusterSpecError,
    InfeasibleError,
    LaunchError,
    PlanError,
    WhalepyError,
)
from whalepy import ClusterSpec

from bad_input_cases import CPU4, TOKENS, a100, assert_clear, cluster4, plan_kw, tiny, write
from bad_input_cases import no_capture, one_rank_launch  # noqa: F401  (fixtures)

sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
mean_loss = lambda out, y: out.float().mean()  # noqa: E731

ANNOTATIONS = [
    ("split(0)", lambda: whalepy.split(0), ("split(0)", "positive integer", "Fix")),
    ("split(2.5)", lambda: whalepy.split(2.5), ("split(2.5)", "Fix")),
    ("split(True)", lambda: whalepy.split(True), ("split(True)", "Fix")),
    ("replicate(-1)", lambda: whalepy.replicate(-1), ("replicate(-1)", "Fix")),
    ("replicate('2')", lambda: whalepy.replicate("2"), ("replicate('2')", "int", "Fix")),
    ("stage(3)", lambda: whalepy.stage(3), ("stage(3)", "takes no arguments", "Fix")),
    ("cluster(nodes=0)", lambda: whalepy.cluster(nodes=0), ("nodes", "positive integer", "Fix")),
    ("cluster(count=-1)", lambda: whalepy.cluster(count=-1), ("count", "positive integer", "Fix")),
    ("cluster(gpu='')", lambda: whalepy.cluster(gpu=""), ("gpu", "Fix")),
    ("cluster(gpu=5)", lambda: whalepy.cluster(gpu=5), ("gpu", "Fix")),
    ("cluster(gpu='V100') ambiguous", lambda: whalepy.cluster(gpu="V100"), ("ambiguous", "'V100-16GB' or 'V100-32GB'")),
    ("cluster(gpu='a100') ambiguous", lambda: whalepy.cluster(gpu="a100"), ("ambiguous", "'A100-40GB' or 'A100-80GB'")),
    ("annotate unknown path", lambda: whalepy.annotate(tiny(), {"transformer.hh.0": whalepy.split(2)}),
     ("matches no module", "closest module paths", "Fix")),
    ("annotate value not annotation", lambda: whalepy.annotate(tiny(), {"transformer.h.0": 2}),
     ("is 2, not an annotation", "Fix")),
    ("annotate spec not a mapping", lambda: whalepy.annotate(tiny(), "transformer.h.0"), ("Fix",)),
    ("annotate not a module", lambda: whalepy.annotate("gpt", {"h": whalepy.split(2)}), ("Fix",)),
]


@pytest.mark.parametrize("fn, needles", [c[1:] for c in ANNOTATIONS], ids=[c[0] for c in ANNOTATIONS])
def test_annotation_mistakes(fn, needles) -> None:
    assert_clear(fn, AnnotationError, *needles)


def _plan(model, cluster=None, **kw):  # type: ignore[no-untyped-def]
    return lambda: whalepy.plan(model, cluster or cluster4(), **plan_kw(**kw))


PLAN_TIME_ANNOTATIONS = [
    ("conflicting split degrees", lambda: _plan(tiny(**{"transformer.h.0": whalepy.split(1),
                                                         "transformer.h.1": whalepy.split(2)}))(),
     AnnotationError, ("conflicting split degrees [1, 2]", "one TP degree")),
    ("split(3) on 4 devices", lambda: _plan(tiny(**{"transformer.h.*.mlp": whalepy.split(3)}))(),
     AnnotationError, ("split(3)", "3 does not divide 4", "leave the degree out")),
    ("split(8) above the heads", lambda: _plan(tiny(**{"transformer.h.*.mlp": whalepy.split(8)}), a100())(),
     AnnotationError, ("split(8)", "2 heads", "valid degrees")),
    ("replicate(64) on 16 GPUs", lambda: _plan(tiny(**{"transformer.h.*": whalepy.replicate(64)}), a100(),
                                                 global_batch=128)(),
     AnnotationError, ("replicate(64)", "64 > 16", "leave the degree out")),
    ("replicate(3) on 4 devices", lambda: _plan(tiny(**{"transformer.h.*": whalepy.replicate(3)}))(),
     AnnotationError, ("replicate(3)", "3 does not divide 4", "divides 4")),
    ("split(4) x replicate(2) on 4", lambda: _plan(tiny(**{"transformer.h.*": [whalepy.split(2),
                                                                              whalepy.replicate(4)]}))(),
     AnnotationError, ("= 8 devices", "cluster has 4")),
    ("cluster(gpu=T4) not in cluster", lambda: _plan(tiny(**{"transformer.h.0": whalepy.cluster(gpu="T4")}))(),
     AnnotationError, ("'T4'", "does not have", "CPU")),
    ("cluster(group=) not in cluster", lambda: _plan(tiny(**{"transformer.h.0": whalepy.cluster(group="fast")}))(),
     AnnotationError, ("'fast'", "does not have")),
    ("cluster(gpu=) unknown custom", lambda: _plan(tiny(**{"transformer.h.0": whalepy.cluster(gpu="RTX9")}))(),
     AnnotationError, ("'RTX9'", "does not have")),
    ("cluster(count=8) on 4 devices", lambda: _plan(tiny(**{"transformer.h.0": whalepy.cluster(count=8)}))(),
     AnnotationError, ("cluster(count=8)", "more than the matching group(s) have", "4 devices on 1 nodes")),
    ("cluster(nodes=5) on 1 node", lambda: _plan(tiny(**{"transformer.h.0": whalepy.cluster(nodes=5)}))(),
     AnnotationError, ("nodes=5", "more than", "add the devices")),
    ("cluster(count=2) part of the only group", lambda: _plan(tiny(**{"transformer.h.0": whalepy.cluster(count=2)}))(),
     AnnotationError, ("count=2 asks for part", "node group of their own")),
]


@pytest.mark.parametrize("fn, exc, needles", [c[1:] for c in PLAN_TIME_ANNOTATIONS],
                         ids=[c[0] for c in PLAN_TIME_ANNOTATIONS])
def test_annotation_mistakes_found_when_planning(fn, exc, needles) -> None:
    assert_clear(fn, exc, *needles)


def _group(**kw):  # type: ignore[no-untyped-def]
    return {"name": "g", "gpu": "CPU", "gpus_per_node": 4, "intra_node": "shm", **kw}


CLUSTER_DICTS = [
    ("top-level list", [1, 2], ("must be a mapping",)),
    ("no groups", {"groups": []}, ("non-empty list under 'groups:'",)),
    ("gpus_per_node 0", {"groups": [_group(gpus_per_node=0)]}, ("gpus_per_node", "got 0", "1 or more")),
    ("gpus_per_node string", {"groups": [_group(gpus_per_node="4")]}, ("gpus_per_node", "'4'")),
    ("nodes -1", {"groups": [_group(nodes=-1)]}, ("nodes", "-1")),
    ("negative bandwidth", {"network": {"bandwidth_gbps": -1}, "groups": [_group()]}, ("bandwidth_gbps", "-1")),
    ("unknown GPU", {"groups": [_group(gpu="A100-80G")]}, ("unknown GPU type 'A100-80G'", "A100-80GB")),
    ("ambiguous GPU", {"groups": [_group(gpu="V100")]}, ("ambiguous", "V100-32GB")),
    ("missing gpu", {"groups": [{"name": "g", "gpus_per_node": 4}]}, ("missing 'gpu'",)),
    ("misspelt key", {"groups": [_group(gpus_per_nodes=4)]}, ("gpus_per_nodes",)),
    ("unknown link kind", {"groups": [_group(intra_node="nvlink9")]}, ("nvlink9",)),
    ("duplicate group names", {"groups": [_group(), _group()]}, ("duplicate group name 'g'", "unique")),
    ("negative host memory", {"groups": [_group(cpu_memory_gb=-1)]}, ("cpu_memory_gb",)),
    ("rank_map wrong length", {"groups": [_group()], "rank_map": ["g"]}, ("rank_map",)),
    ("rank_map unknown group", {"groups": [_group()], "rank_map": ["g", "g", "g", "x"]}, ("rank_map", "'x'")),
    ("custom device missing field", {"devices": {"MyGPU": {"peak_tflops_16": 10}},
                                     "groups": [_group(gpu="MyGPU", intra_node="pcie4")]}, ("MyGPU",)),
    ("nvme missing read_gbs", {"groups": [_group(nvme={"capacity_tb": 1, "write_gbs": 1})]}, ("read_gbs",)),
    ("host memory in bytes", {"groups": [_group(cpu_memory_gb=512 * 2**30)]},
     ("cpu_memory_gb: 549755813888", "more than any hardware has", "in bytes, write cpu_memory_gb: 512")),
    ("NVMe capacity in GB", {"groups": [_group(cpu_memory_gb=64, nvme={"capacity_tb": 3840, "read_gbs": 6.8,
                                                                      "write_gbs": 4})]},
     ("capacity_tb: 3840", "in GB, write capacity_tb: 3.84")),
    ("NVMe read in MB/s", {"groups": [_group(cpu_memory_gb=64, nvme={"capacity_tb": 3.84, "read_gbs": 6800,
                                                                    "write_gbs": 4})]},
     ("read_gbs: 6800", "in MB/s, write read_gbs: 6.8")),
    ("network in bit/s", {"network": {"bandwidth_gbps": 1e11}, "groups": [_group()]},
     ("bandwidth_gbps", "in bit/s, write bandwidth_gbps: 100")),
    ("custom device memory in bytes", {"devices": {"X": {"peak_tflops_16": 1, "peak_tflops_32": 1, "memory_gb": 80e9,
                                                         "memory_bandwidth_gbs": 100, "host_link_gbs": 10}},
                                       "groups": [_group(gpu="X", intra_node="pcie4")]},
     ("memory_gb: 80000000000.0", "in bytes, write memory_gb: 74.51")),
]


@pytest.mark.parametrize("data, needles", [c[1:] for c in CLUSTER_DICTS], ids=[c[0] for c in CLUSTER_DICTS])
def test_cluster_spec_mistakes(data, needles) -> None:
    assert_clear(lambda: ClusterSpec.from_dict(data), ClusterSpecError, *needles)


CLUSTER_FILES = [
    ("missing file", None, "nope.yaml", ("cannot read cluster spec", "examples")),
    ("malformed YAML", "groups: [ {name: a, gpu: CPU\n", "c.yaml", ("not valid YAML", "line", "fix the syntax")),
    ("malformed JSON", "{bad", "c.json", ("not valid JSON", "fix the syntax")),
    ("empty YAML", "", "c.yaml", ("mapping",)),
    ("binary file", "\udcff\udcfegroups", "c.yaml", ("not UTF-8 text", "byte 0")),
    ("YAML key given twice", "groups:\n  - {name: g, gpu: CPU, gpus_per_node: 2, gpus_per_node: 4, intra_node: shm}\n",
     "c.yaml", ("key 'gpus_per_node' is given twice", "line 2", "keep one")),
    ("JSON key given twice", '{"groups": [], "groups": [{"name": "g"}]}', "c.json", ("key 'groups' is given twice",)),
]


@pytest.mark.parametrize("text, name, needles", [c[1:] for c in CLUSTER_FILES], ids=[c[0] for c in CLUSTER_FILES])
def test_cluster_file_mistakes(tmp_path: Path, text, name, needles) -> None:
    path = str(tmp_path / name)
    if text is not None:
        (tmp_path / name).write_bytes(text.encode("utf-8", "surrogateescape"))  # lone surrogates: raw bytes
    assert_clear(lambda: ClusterSpec.load(path), ClusterSpecError, *needles)


@pytest.mark.parametrize("n", [0, -2, "4", 2.5])
def test_local_cluster_count(n) -> None:
    assert_clear(lambda: ClusterSpec.local(n), ClusterSpecError, "ClusterSpec.local", "positive integer")


PLANNER = [
    ("cluster is an int", lambda: whalepy.plan(tiny(), 4, **plan_kw()), ClusterSpecError,
     ("cluster is a int", "path of a YAML / JSON spec")),
    ("cluster path missing", lambda: whalepy.plan(tiny(), "nope.yaml", **plan_kw()), ClusterSpecError,
     ("cannot read cluster spec 'nope.yaml'",)),
    ("model is a name", lambda: whalepy.plan("gpt2", cluster4(), **plan_kw()), ArgumentError,
     ("needs a torch.nn.Module", "`whalepy plan NAME"),),
    ("model is None", lambda: whalepy.plan(None, cluster4(), **plan_kw()), ArgumentError, ("nn.Module",)),
    ("empty nn.Sequential", lambda: whalepy.plan(torch.nn.Sequential(), cluster4(), **plan_kw()), ArgumentError,
     ("Sequential has no parameters", "nothing to train")),
    ("model without parameters", lambda: whalepy.profile(torch.nn.ReLU(), (torch.zeros(1, 4),)), ArgumentError,
     ("whalepy.profile(): ReLU has no parameters",)),
    ("global batch in tokens (10**12), answered at once", lambda: whalepy.plan(tiny(), cluster4(),
                                                                               **plan_kw(global_batch=10**12)),
     InfeasibleError, ("no plan fits", "a smaller micro-batch")),
    ("example inputs None", lambda: whalepy.plan(tiny(), cluster4(), example_inputs=None, global_batch=8),
     ArgumentError, ("example_inputs is None", "torch.zeros")),
    ("example inputs empty", lambda: whalepy.plan(tiny(), cluster4(), example_inputs=(), global_batch=8),
     ArgumentError, ("empty",)),
    ("example inputs a list", lambda: whalepy.plan(tiny(), cluster4(), example_inputs=([1, 2],), global_batch=8),
     ArgumentError, ("example_inputs[0] is a list", "pass tensors")),
    ("example inputs float", lambda: whalepy.plan(tiny(), cluster4(), example_inputs=(torch.zeros(1, 8),),
                                                  global_batch=8),
     ArgumentError, ("float32[1, 8]", "integer token ids", ".long()")),
    ("example inputs too long", lambda: whalepy.plan(tiny(), cluster4(), global_batch=8,
                                                     example_inputs=(torch.zeros(1, 64, dtype=torch.long),)),
     ArgumentError, ("64 tokens", "16 positions (config.block_size)", "at most 16")),
    ("example inputs empty batch", lambda: whalepy.plan(tiny(), cluster4(), global_batch=8,
                                                        example_inputs=(torch.zeros(0, 8, dtype=torch.long),)),
     ArgumentError, ("empty batch", "at least one sample")),
    ("global_batch 0", _plan(tiny(), global_batch=0), PlanError, ("global_batch", "got 0", "global_batch=256")),
    ("global_batch -4", _plan(tiny(), global_batch=-4), PlanError, ("got -4",)),
    ("global_batch float", _plan(tiny(), global_batch=8.0), PlanError, ("got 8.0",)),
    ("global_batch str", _plan(tiny(), global_batch="8"), PlanError, ("got '8'",)),
    ("global_batch True", _plan(tiny(), global_batch=True), PlanError, ("got True",)),
    ("unknown option", _plan(tiny(), zero_stage=(1,)), PlanError, ("'zero_stage'", "did you mean zero_stages")),
    ("unknown solver", _plan(tiny(), solver="gurobi"), PlanError, ("'gurobi'", "highs")),
    ("time limit 0", _plan(tiny(), time_limit_s=0), PlanError, ("time_limit_s", "positive")),
    ("time limit str", _plan(tiny(), time_limit_s="60"), PlanError, ("time_limit_s='60'", "number of seconds")),
    ("max_tp 3", _plan(tiny(), max_tp=3), PlanError, ("max_tp=3", "power of two")),
    ("max_tp str", _plan(tiny(), max_tp="2"), PlanError, ("max_tp='2'", "integer")),
    ("zero stages letters", _plan(tiny(), zero_stages=("a", "b")), PlanError, ("zero_stages", "0, 1, 2, 3")),
    ("zero stage 5", _plan(tiny(), zero_stages=(5,)), PlanError, ("zero_stages=(5,)", "0, 1, 2, 3")),
    ("zero stages an int", _plan(tiny(), zero_stages=1), PlanError, ("zero_stages=1", "tuple")),
    ("schedules a string", _plan(tiny(), schedules="1f1b"), PlanError, ("schedules='1f1b'", "tuple of names")),
    ("unknown schedule", _plan(tiny(), schedules=("zigzag",)), PlanError, ("unknown schedule", "gpipe")),
    ("no schedules", _plan(tiny(), schedules=()), PlanError, ("schedules is empty",)),
    ("precision int8", _plan(tiny(), precision="int8"), PlanError, ("precision='int8'", "bf16, fp16 or fp32")),
    ("top_k -1", _plan(tiny(), top_k=-1), PlanError, ("top_k", ">= 0")),
    ("virtual stages 0", _plan(tiny(), virtual_stages=(0,)), PlanError, ("virtual_stages", ">= 1")),
    ("max_microbatches 0", _plan(tiny(), max_microbatches=0), PlanError, ("max_microbatches", ">= 1")),
    ("allow_offload a string", _plan(tiny(), allow_offload="no"), PlanError, ("allow_offload='no'", "True or False")),
    ("progress a number", _plan(tiny(), progress=5), PlanError, ("progress=5", "callable")),
    ("fp16 on an fp32-only device", _plan(tiny(), cluster=ClusterSpec.from_dict(
        {"groups": [{"name": "p", "gpu": "P100", "gpus_per_node": 4, "intra_node": "pcie3"}]}), precision="bf16"),
     PlanError, ("bf16", "P100")),
]


@pytest.mark.parametrize("fn, exc, needles", [c[1:] for c in PLANNER], ids=[c[0] for c in PLANNER])
def test_planner_argument_mistakes(fn, exc, needles) -> None:
    assert_clear(fn, exc, *needles)


def _estimate(config, **kw):  # type: ignore[no-untyped-def]
    return lambda: whalepy.estimate(tiny(), cluster4(), config, **plan_kw(**kw))


ESTIMATE = [
    ("degrees do not multiply to the world", _estimate({"dp": 3, "tp": 2}),
     PlanError, ("dp(3) * tp(2) * pp(1) = 6 != world size (4)",)),
    ("dp 0", lambda: whalepy.ParallelConfig(dp=0), PlanError, ("ParallelConfig.dp", "got 0")),
    ("zero stage 5", _estimate({"dp": 4, "zero_stage": 5}), PlanError, ("zero_stage",)),
    ("unknown config key", _estimate({"dp": 4, "zeros": 1}), PlanError, ("unknown config key(s) ['zeros']",)),
    ("config a list", _estimate([4, 1, 1]), PlanError, ("ParallelConfig or a dict", "list")),
    ("unknown schedule", _estimate({"dp": 2, "pp": 2, "num_microbatches": 2, "schedule": "zigzag"}),
     PlanError, ("zigzag",)),
    ("offload to disk", _estimate({"dp": 4, "offload": "disk"}), PlanError, ("offload='disk'", "'cpu' or 'nvme'")),
    ("pp above the blocks", lambda: whalepy.estimate(tiny(), a100(), {"dp": 1, "pp": 16, "num_microbatches": 16},
                                                     **plan_kw(global_batch=16)),
     PlanError, ("16 (virtual) stages for 4 blocks", "at least one block")),
    ("tp 3", lambda: whalepy.ParallelConfig(dp=1, tp=3), PlanError, ("tp=3", "power of two")),
    ("dp True", lambda: whalepy.ParallelConfig(dp=True), PlanError, ("ParallelConfig.dp", "True")),
    ("global batch 0", _estimate({"dp": 4}, global_batch=0), ArgumentError, ("global_batch", "got 0")),
    ("cluster is a list", lambda: whalepy.estimate(tiny(), [1], {"dp": 4}, **plan_kw()), ClusterSpecError,
     ("cluster is a list",)),
    ("model is a string", lambda: whalepy.estimate("gpt2", cluster4(), {"dp": 4}, **plan_kw()), ArgumentError,
     ("nn.Module",)),
    ("profile of a non-module", lambda: whalepy.profile(42, (TOKENS,)), ArgumentError, ("whalepy.profile()", "int")),
    ("profile of float tokens", lambda: whalepy.profile(tiny(), (torch.zeros(1, 8),)), ArgumentError,
     ("integer token ids",)),
]


@pytest.mark.parametrize("fn, exc, needles", [c[1:] for c in ESTIMATE], ids=[c[0] for c in ESTIMATE])
def test_estimate_and_profile_mistakes(fn, exc, needles) -> None:
    assert_clear(fn, exc, *needles)


ESTIMATE_BEFORE_CAPTURE = [  # what the configuration asks of the cluster and the batch needs no model
    ("global batch 0", _estimate({"dp": 4}, global_batch=0), ArgumentError, ("global_batch", "got 0")),
    ("degrees do not multiply to the world", _estimate({"dp": 3}), PlanError, ("dp(3) * tp(1) * pp(1) = 3",)),
    ("batch not divisible by dp", _estimate({"dp": 4}, global_batch=6), PlanError, ("does not split evenly over dp=4",)),
    ("micro-batches do not divide", _estimate({"dp": 4, "num_microbatches": 3}), PlanError, ("3 equal micro-batches",)),
    ("batch shares of the wrong length", _estimate({"dp": 4, "batch_shares": (4, 4)}), PlanError, ("4 positive numbers",)),
    ("precision unknown", _estimate({"dp": 4}, precision="half"), PlanError, ("'half'", "bf16, fp16 or fp32")),
    ("tp beyond a node", lambda: whalepy.estimate(tiny(), {"network": {"bandwidth_gbps": 100}, "groups": [
        {"name": "g", "gpu": "CPU", "gpus_per_node": 2, "nodes": 2, "intra_node": "shm"}]}, {"dp": 1, "tp": 4},
        **plan_kw()), PlanError, ("tp=4 does not divide the 2 GPUs per node",)),
]


@pytest.mark.parametrize("fn, exc, needles", [c[1:] for c in ESTIMATE_BEFORE_CAPTURE],
                         ids=[c[0] for c in ESTIMATE_BEFORE_CAPTURE])
def test_estimate_mistakes_before_the_capture(no_capture, fn, exc, needles) -> None:
    assert_clear(fn, exc, *needles)


def _parallelize(**kw):  # type: ignore[no-untyped-def]
    args = dict(model=tiny(), cluster_spec=cluster4(), example_inputs=(TOKENS,), loss_fn=mean_loss,
                optimizer=sgd, global_batch=8)
    args.update(kw)
    model, spec = args.pop("model"), args.pop("cluster_spec")
    return lambda: whalepy.parallelize(model, spec, **args)


def _plan_of_tiny():  # type: ignore[no-untyped-def]
    return whalepy.estimate(tiny(), cluster4(), {"dp": 4}, **plan_kw()).plan


RUNTIME = [
    ("model not a module", _parallelize(model=None), ArgumentError, ("nn.Module",)),
    ("optimizer instance", _parallelize(optimizer=torch.optim.SGD(tiny().parameters(), lr=0.1)), ArgumentError,
     ("takes a factory", "lambda params")),
    ("optimizer not callable", _parallelize(optimizer="adamw"), ArgumentError, ("callable", "lambda params")),
    ("loss_fn not callable", _parallelize(loss_fn="cross_entropy"), ArgumentError, ("loss_fn", "F.cross_entropy")),
    ("cluster None and no plan", _parallelize(cluster_spec=None), ClusterSpecError, ("NoneType", "ClusterSpec")),
    ("global_batch 0", _parallelize(global_batch=0), ArgumentError, ("global_batch", "got 0")),
    ("plan given as a path", _parallelize(plan="plan.json"), ArgumentError, ("whalepy.Plan", "Plan.load")),
    ("planner options with a plan", lambda: _parallelize(plan=_plan_of_tiny(), solver="cbc")(), ArgumentError,
     ("['solver']", "drop")),
    ("plan for another global batch", lambda: _parallelize(plan=_plan_of_tiny(), global_batch=16)(), PlanError,
     ("global batch of 8", "global_batch=16")),
    ("plan for another cluster size", lambda: _parallelize(plan=_plan_of_tiny(), cluster_spec=ClusterSpec.local(8))(),
     PlanError, ("plan is for 4 devices but the cluster spec has 8",)),
    ("plan for other device types", lambda: _parallelize(plan=_plan_of_tiny(), cluster_spec=ClusterSpec.from_dict(
        {"groups": [{"name": "t", "gpu": "T4", "gpus_per_node": 4, "intra_node": "pcie3", "simulated": True}]}))(),
     PlanError, ("puts a CPU on rank 0", "has a T4 there", "re-plan")),
    ("checkpoint missing", _parallelize(checkpoint="/nonexistent/ckpt"), WhalepyError,
     ("/nonexistent/ckpt",)),
    ("float example inputs", _parallelize(example_inputs=(torch.zeros(1, 8),)), ArgumentError, ("token ids",)),
]

RUNTIME_BEFORE_CAPTURE = [
    ("loss_parallel a string", _parallelize(loss_parallel="yes"), ArgumentError, ("loss_parallel='yes'", "True or False")),
    ("sync_initial_weights a string", _parallelize(sync_initial_weights="no"), ArgumentError,
     ("sync_initial_weights='no'",)),
    ("seed negative", _parallelize(seed=-1), ArgumentError, ("seed=-1", "integer >= 0")),
    ("seed a string", _parallelize(seed="0"), ArgumentError, ("seed='0'",)),
    ("init_fn not callable", _parallelize(init_fn=5), ArgumentError, ("init_fn=5", "callable")),
    ("profile a string", _parallelize(profile="gpt"), ArgumentError, ("ModelProfile", "got str")),
    ("checkpoint an int", _parallelize(checkpoint=5), ArgumentError, ("checkpoint=5", "path of a checkpoint")),
    ("nvme_dir empty", _parallelize(nvme_dir=""), ArgumentError, ("nvme_dir='' is an empty path",)),
    ("loss_fn of one argument", _parallelize(loss_fn=lambda out: out.mean()), ArgumentError,
     ("loss_fn(outputs, targets)", "F.cross_entropy")),
    ("optimizer factory of two arguments", _parallelize(optimizer=lambda params, lr: None), ArgumentError,
     ("with the parameters alone", "lambda params")),
    ("model without parameters", _parallelize(model=torch.nn.ReLU(), example_inputs=(torch.zeros(1, 4),)),
     ArgumentError, ("ReLU has no parameters",)),
]


@pytest.mark.parametrize("fn, exc, needles", [c[1:] for c in RUNTIME], ids=[c[0] for c in RUNTIME])
def test_runtime_argument_mistakes(fn, exc, needles) -> None:
    assert_clear(fn, exc, *needles)


@pytest.mark.parametrize("fn, exc, needles", [c[1:] for c in RUNTIME_BEFORE_CAPTURE],
                         ids=[c[0] for c in RUNTIME_BEFORE_CAPTURE])
def test_runtime_argument_mistakes_before_the_capture(no_capture, fn, exc, needles) -> None:
    assert_clear(fn, exc, *needles)


def test_train_step_before_launch_says_how_to_launch(capsys) -> None:
    pm = _parallelize()()
    batch = torch.zeros(8, 8, dtype=torch.long)
    for call in (lambda: pm.train_step(batch, batch), pm.state_dict, lambda: pm.save("ckpt"),
                 lambda: pm.load("ckpt")):
        assert_clear(call, LaunchError, "not inside a distributed launch", "torchrun --nproc-per-node 4")


LOSSES = [
    ("vector", lambda: torch.ones(3), ("shape (3,)", "not a scalar", ".mean()")),
    ("python float", lambda: 1.0, ("returned a float", "scalar tensor")),
    ("integer tensor", lambda: torch.tensor(1), ("torch.int64", "floating point")),
]


@pytest.mark.parametrize("result, needles", [c[1:] for c in LOSSES], ids=[c[0] for c in LOSSES])
def test_loss_fn_must_return_a_scalar(result, needles) -> None:
    from whalepy.runtime.parallel_model import _checked_loss

    assert_clear(lambda: _checked_loss(lambda out, y: result())(None, None), ArgumentError, *needles)


CORRECT = [
    ("cluster as a path", lambda: whalepy.plan(tiny(), CPU4, **plan_kw())),
    ("cluster as a dict", lambda: whalepy.plan(tiny(), {"groups": [_group()]}, **plan_kw())),
    ("global batch 3 on 4 devices", lambda: whalepy.plan(tiny(), cluster4(), **plan_kw(global_batch=3))),
]


@pytest.mark.parametrize("fn", [c[1] for c in CORRECT], ids=[c[0] for c in CORRECT])
def test_friendly_inputs_are_accepted(fn) -> None:
    plan = fn()
    assert plan.world_size == 4 and sum(plan.batch_shares) == plan.global_batch


def test_device_too_small_says_what_to_fix() -> None:
    tiny_gpu = ClusterSpec.from_dict({"devices": {"Tiny": {
        "peak_tflops_16": 1, "peak_tflops_32": 1, "memory_gb": 0.5, "memory_bandwidth_gbs": 10, "host_link_gbs": 1}},
        "groups": [{"name": "t", "gpu": "Tiny", "gpus_per_node": 1, "intra_node": "pcie3"}]})
    assert_clear(lambda: whalepy.plan(tiny(), tiny_gpu, **plan_kw()), InfeasibleError,
                 "'Tiny'", "0.5 GiB", "give the device's real memory_gb")


class _NestedSplits(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with whalepy.split(2), whalepy.split(4):
            self.fc = torch.nn.Linear(4, 4)


class _NestedStages(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with whalepy.stage(), whalepy.stage():
            self.fc = torch.nn.Linear(4, 4)


def _decorate_plain_class() -> None:
    @whalepy.split(2)
    class Plain:  # not an nn.Module
        pass


MORE = [
    ("nested splits of different degrees", lambda: whalepy.resolve_annotations(_NestedSplits()), AnnotationError,
     ("split(4)", "nested inside split(2)", "Fix")),
    ("nested stages", lambda: whalepy.resolve_annotations(_NestedStages()), AnnotationError,
     ("stages cannot nest", "Fix")),
    ("split decorating a plain class", _decorate_plain_class, AnnotationError, ("nn.Module subclasses", "Fix")),
    ("glob range beyond the layers", lambda: whalepy.annotate(tiny(), {"transformer.h.0-9": whalepy.stage()}),
     AnnotationError, ("range 0-9", "indices 2-9", "Fix")),
    ("glob range backwards", lambda: whalepy.annotate(tiny(), {"transformer.h.1-0": whalepy.split(2)}),
     AnnotationError, ("runs backwards", "write 0-1")),
    ("stage scopes not dividing the world", lambda: whalepy.plan(tiny(**{
        "transformer.h.0": whalepy.stage(), "transformer.h.1": whalepy.stage(), "lm_head": whalepy.stage()}),
        cluster4(), **plan_kw()), AnnotationError, ("3 pipeline stages", "3 does not divide 4")),
    ("stage scopes interleaved", lambda: (lambda s0, s1: whalepy.plan(tiny(**{
        "transformer.h.0": s0, "transformer.h.1": s1, "lm_head": s0}), cluster4(), **plan_kw()))(
        whalepy.stage(), whalepy.stage()), AnnotationError, ("contiguous", "Fix")),
    ("cluster(count=) part of a group", lambda: whalepy.plan(tiny(**{
        "transformer.h.0": whalepy.cluster(gpu="CPU", count=2)}), cluster4(), **plan_kw()), AnnotationError,
     ("count=2 asks for part", "node group of their own")),
    ("profile option misspelt", lambda: whalepy.profile(tiny(), (TOKENS,), sequence_paralel=True), ArgumentError,
     ("'sequence_paralel'", "sequence_parallel")),
    ("capture fails on keyword inputs", lambda: whalepy.profile(tiny(), {"input_ids": TOKENS}), CaptureError,
     ("could not capture GPT", "'input_ids'", "Usual fixes")),
    ("plan_from_profile of a model", lambda: whalepy.plan_from_profile(tiny(), cluster4(), global_batch=8),
     PlanError, ("ModelProfile", "whalepy.profile(model")),
    ("ClusterSpec.load(None)", lambda: ClusterSpec.load(None), ClusterSpecError, ("path of a YAML / JSON spec",)),
    ("groups not a list", lambda: ClusterSpec.from_dict({"groups": {"name": "a"}}), ClusterSpecError,
     ("non-empty list under 'groups:'",)),
    ("group not a mapping", lambda: ClusterSpec.from_dict({"groups": [["a"]]}), ClusterSpecError,
     ("groups[0] must be a mapping",)),
    ("network a string", lambda: ClusterSpec.from_dict({"network": "fast", "groups": [_group()]}), ClusterSpecError,
     ("network must be a mapping",)),
    ("GPUs without an intra-node link", lambda: ClusterSpec.from_dict({"groups": [
        {"name": "g", "gpu": "A100-80GB", "gpus_per_node": 8}]}), ClusterSpecError, ("no intra-node link", "nvswitch")),
    ("two groups without a network", lambda: ClusterSpec.from_dict({"groups": [
        {"name": "g", "gpu": "A100-80GB", "gpus_per_node": 8, "intra_node": "nvswitch"},
        {"name": "h", "gpu": "T4", "gpus_per_node": 4, "intra_node": "pcie3"}]}), ClusterSpecError,
     ("no network bandwidth", "bandwidth_gbps")),
    ("estimate boundaries", _estimate({"dp": 2, "pp": 2, "num_microbatches": 2, "boundaries": (1, 1)}), PlanError,
     ("boundaries [1, 1]", "summing to 4")),
    ("estimate batch shares", _estimate({"dp": 4, "batch_shares": (1, 1, 1, 1)}), PlanError,
     ("batch_shares [1, 1, 1, 1]", "summing to 8")),
    ("estimate checkpoint counts", _estimate({"dp": 2, "pp": 2, "num_microbatches": 2, "checkpoint": (1,)}),
     PlanError, ("1 counts for 2 stages",)),
    ("estimate layout", _estimate({"dp": 4, "layout": "rows"}), PlanError, ("'replicas' or 'stages'",)),
    ("estimate micro-batches", _estimate({"dp": 4, "num_microbatches": 3}), PlanError, ("3 equal micro-batches",)),
    ("estimate interleaved without pipeline", _estimate({"dp": 4, "schedule": "interleaved_1f1b",
                                                         "virtual_stages": 2}), PlanError, ("virtual_stages=2",)),
    ("estimate precision", lambda: whalepy.estimate(tiny(), cluster4(), {"dp": 4}, **plan_kw(), precision="int8"),
     PlanError, ("'int8'", "bf16, fp16 or fp32")),
    ("export of a missing checkpoint", lambda: whalepy.export_safetensors("/nonexistent", "/tmp/whalepy-out"),
     WhalepyError, ("/nonexistent", "ParallelModel.save")),
    ("export shard size 0", lambda: whalepy.export_safetensors("/nonexistent", "/tmp/o", max_shard_size=0),
     WhalepyError, ("shard size 0", "5GB")),
    ("export shard size with a typo", lambda: whalepy.export_safetensors("/nonexistent", "/tmp/o", max_shard_size="5XB"),
     WhalepyError, ("'5XB'",)),
    ("export dtype a string", lambda: whalepy.export_safetensors("/nonexistent", "/tmp/o", dtype="bf16"),
     WhalepyError, ("dtype='bf16'", "torch.bfloat16")),
    ("export checkpoint an int", lambda: whalepy.export_safetensors(5, "/tmp/o"), ArgumentError, ("got int 5",)),
    ("pseudo_to_real of a name", lambda: whalepy.pseudo_to_real("gpt"), ArgumentError, ("needs an nn.Module",)),
    ("delink of a name", lambda: whalepy.delink("gpt"), ArgumentError, ("pseudo model", "got str")),
    ("delink with an optimizer name", lambda: whalepy.delink(whalepy.pseudo_to_real(tiny()), optimizer="adam"),
     ArgumentError, ("torch.optim.Optimizer", "got str")),
    ("profile option not a bool", lambda: whalepy.profile(tiny(), (TOKENS,), sequence_parallel="yes"),
     ArgumentError, ("sequence_parallel='yes'", "True or False")),
    ("token ids beyond the vocabulary", lambda: whalepy.profile(tiny(), (torch.full((1, 8), 100),)),
     ArgumentError, ("token id 100", "32 rows", "model's own vocabulary")),
    ("ClusterSpec.local(device_type=5)", lambda: ClusterSpec.local(2, device_type=5), ClusterSpecError,
     ("device_type=5", "'H100-SXM'")),
    ("Plan.save into a directory", lambda: _plan_of_tiny().save("/tmp"), PlanError, ("is a directory", "plan.json")),
    ("Plan.save into a missing directory", lambda: _plan_of_tiny().save("/nonexistent/p.json"), PlanError,
     ("'/nonexistent' does not exist", "mkdir -p")),
    ("materialize a built model", lambda: whalepy.materialize(tiny()), WhalepyError, ("meta device",)),
    ("calibrate an unknown device", lambda: whalepy.calibrate(device="tpu"), ArgumentError, ("'tpu'", "'cpu'")),
]


@pytest.mark.parametrize("fn, exc, needles", [c[1:] for c in MORE], ids=[c[0] for c in MORE])
def test_more_mistakes(fn, exc, needles) -> None:
    assert_clear(fn, exc, *needles)


def test_train_step_mistakes(one_rank_launch) -> None:
    one = ClusterSpec.local(1)
    pm = whalepy.parallelize(tiny(), one, example_inputs=(TOKENS,), loss_fn=mean_loss, optimizer=sgd,
                             global_batch=4)
    ok = torch.zeros(4, 8, dtype=torch.long)
    pm.train_step(ok, ok)  # the happy path runs
    assert_clear(lambda: pm.train_step(ok[:3], ok[:3]), ArgumentError, "shape (3, 8)", "whole global batch (4")
    assert_clear(lambda: pm.train_step(ok, ok[:2]), ArgumentError, "shape (2, 8)")
    assert_clear(lambda: pm.train_step([[1, 2]], ok), ArgumentError, "got a list where a tensor is expected")
    assert_clear(lambda: pm.train_step({"idx": ok}, ok), ArgumentError, "tuple of tensors", "got dict")
    long = torch.zeros(4, 32, dtype=torch.long)
    assert_clear(lambda: pm.train_step(long, long), ArgumentError, "32 tokens", "16 positions", "shorten")
    assert_clear(lambda: pm.train_step(torch.full((4, 8), 40), ok), ArgumentError, "token id 40",
                 "transformer.wte has 32 rows", "model's own vocabulary")
    assert_clear(lambda: pm.train_step(torch.full((4, 8), -1), ok), ArgumentError, "token id -1")
    assert_clear(lambda: pm.train_step(ok.float(), ok), ArgumentError, "float32[4, 8]", "integer token ids")
    assert_clear(lambda: pm.train_step(ok[:, 0], ok), ArgumentError, "shape (4,)", "example input had 2")
    assert_clear(lambda: pm.train_step((ok, ok), ok), ArgumentError, "2 model inputs", "train_step(inputs, targets)")
    assert_clear(lambda: pm.train_step(ok.to("meta"), ok), ArgumentError, "meta device")
    assert_clear(lambda: pm.load_state_dict({"x": 1}), ArgumentError, "ParallelModel.state_dict()", "['x']")
    assert_clear(lambda: pm.save(5), ArgumentError, "directory path, got int 5")
    afile = one_rank_launch / "afile"
    afile.write_text("x")
    assert_clear(lambda: pm.save(str(afile / "ckpt")), ArgumentError, "is a file, not a directory")
    vector = whalepy.parallelize(tiny(), one, example_inputs=(TOKENS,), optimizer=sgd, global_batch=4,
                                 loss_fn=lambda out, y: out.float().mean(dim=-1))
    assert_clear(lambda: vector.train_step(ok, ok), ArgumentError, "not a scalar", ".mean()")
    pm.save(str(one_rank_launch / "ckpt"))
    wider = whalepy.models.GPT(whalepy.models.GPTConfig(vocab_size=32, block_size=16, num_layers=2, num_heads=2,
                                                        hidden_size=32))
    pw = whalepy.parallelize(wider, one, example_inputs=(TOKENS,), loss_fn=mean_loss, optimizer=sgd, global_batch=4)
    assert_clear(lambda: pw.load(str(one_rank_launch / "ckpt")), WhalepyError, "shape [32, 16]", "[32, 32]",
                 "other sizes")
    assert_clear(lambda: pw.load(str(one_rank_launch)), WhalepyError, "no .metadata", "pm.save()")
    import shutil

    for name, damage in (("truncated .metadata", lambda d: (d / ".metadata").write_bytes(b"\x80\x04")),
                         ("truncated data", lambda d: [f.write_bytes(b"") for f in d.glob("*.distcp")]),
                         ("missing data", lambda d: [f.unlink() for f in d.glob("*.distcp")])):
        bad = one_rank_launch / name.replace(" ", "_")
        shutil.copytree(one_rank_launch / "ckpt", bad)
        damage(bad)
        # the checksums written at save (whalepy.runtime.commit) catch a changed file first ("corrupted");
        # a checkpoint without them is still read and found damaged
        msg = assert_clear(lambda: pm.load(str(bad)), WhalepyError, "use an earlier checkpoint")
        assert "is corrupted" in msg or "is damaged" in msg, msg
        if name.startswith("truncated ."):
            assert_clear(lambda: whalepy.export_safetensors(str(bad), str(one_rank_launch / "out"), config={}),
                         WhalepyError, ".metadata cannot be read")
    pm.load(str(one_rank_launch / "ckpt"))  # the intact one still loads
    other = whalepy.estimate(tiny(), ClusterSpec.local(2), {"dp": 2}, **plan_kw()).plan
    assert_clear(lambda: whalepy.parallelize(tiny(), one, example_inputs=(TOKENS,), loss_fn=mean_loss,
                                             optimizer=sgd, global_batch=8, plan=other),
                 LaunchError, "2", "torchrun --nproc-per-node 2")
