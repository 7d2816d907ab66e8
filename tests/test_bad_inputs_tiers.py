"""Bad input to the memory-tier features (issue 10): planner options, host memory and NVMe in cluster specs,
``make_plan`` tiers and tiles, ``parallelize(nvme_dir=...)``, ``trace_memory`` and the command line. Each is
one whalepy error line naming the offending value and the fix, raised before the expensive work (the
capture, the planner's search, the disk tier's files). Fast: no processes, tiny models."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import whalepy
from whalepy import ArgumentError, ClusterSpecError, DiskSpaceError, PlanError, WhalepyError
from whalepy.tools.cli import main
from whalepy.hardware.cluster import ClusterSpec, NodeGroup
from whalepy.ir.plan import BlockPlan, StageCost, Tier
from whalepy.planner import PlannerOptions
from whalepy.runtime import make_plan
from whalepy.frontend.trace import trace_memory

from bad_input_cases import CPU4, TOKENS, assert_clear, cluster4, plan_kw, tiny, write
from bad_input_cases import no_capture, one_rank_launch  # noqa: F401  (fixtures)

BLOCKS = ["embed", "transformer.h.0", "transformer.h.1", "head"]  # tiny()'s blocks


# -- planner options: refused before the capture -------------------------------------------------------

OPTIONS = [
    ("typo alow_offload", dict(alow_offload=False), ("'alow_offload'", "did you mean allow_offload", "options are:")),
    ("typo allow_activation_ofload", dict(allow_activation_ofload=False),
     ("'allow_activation_ofload'", "did you mean allow_activation_offload")),
    ("allow_activation_offload 'no'", dict(allow_activation_offload="no"),
     ("allow_activation_offload='no'", "True or False")),
    ("allow_checkpoint_offload 1", dict(allow_checkpoint_offload=1), ("allow_checkpoint_offload=1", "True or False")),
    ("allow_offload None", dict(allow_offload=None), ("allow_offload=None", "True or False")),
    ("mixed_tiers 'yes'", dict(mixed_tiers="yes"), ("mixed_tiers='yes'", "True or False")),
    ("clip_gradients 1.0", dict(clip_gradients=1.0), ("clip_gradients=1.0", "True or False")),
    ("sequence_parallel 'on'", dict(sequence_parallel="on"), ("sequence_parallel='on'", "True or False")),
    ("zero_stages (2.5,)", dict(zero_stages=(2.5,)), ("zero_stages=(2.5,)", "0, 1, 2, 3", "zero_stages=(0, 1, 2, 3)")),
    ("zero_stages ('1',)", dict(zero_stages=("1",)), ("zero_stages=('1',)", "0, 1, 2, 3")),
    ("zero_stages (True,)", dict(zero_stages=(True,)), ("zero_stages=(True,)",)),
    ("zero_stages (-1,)", dict(zero_stages=(-1,)), ("zero_stages=(-1,)",)),
    ("max_microbatches -1", dict(max_microbatches=-1), ("max_microbatches", "got -1", "max_microbatches=64", "None")),
    ("max_microbatches 2.5", dict(max_microbatches=2.5), ("max_microbatches=2.5", "an integer or None")),
    ("time_limit_s -1", dict(time_limit_s=-1), ("time_limit_s", "got -1", "time_limit_s=60")),
    ("time_limit_s nan", dict(time_limit_s=float("nan")), ("time_limit_s", "got nan")),
    ("ilp_time_limit_s 0", dict(ilp_time_limit_s=0), ("ilp_time_limit_s", "got 0", "ilp_time_limit_s=5")),
    ("precision 'int8'", dict(precision="int8"), ("precision='int8'", "bf16, fp16 or fp32")),
    ("max_tp 0", dict(max_tp=0), ("max_tp=0", "power of two", "max_tp=8")),
    ("notes a string", dict(notes="x"), ("notes='x'", "a tuple of lines")),
    ("memory_trace missing file", dict(memory_trace="nope.json"), ("memory_trace='nope.json'", "no such file",
                                                                   "whalepy.trace_memory(model, batch).save(path)")),
    ("memory_trace a dict", dict(memory_trace={"a": 1}), ("memory_trace={'a': 1}", "MemoryTrace")),
]


@pytest.mark.parametrize("options, needles", [c[1:] for c in OPTIONS], ids=[c[0] for c in OPTIONS])
def test_planner_option_mistakes_before_the_capture(no_capture, options, needles) -> None:
    assert_clear(lambda: whalepy.plan(tiny(), cluster4(), **plan_kw(**options)), PlanError, *needles)


def test_planner_options_object() -> None:
    assert_clear(lambda: PlannerOptions(alow_offload=True), PlanError, "'alow_offload'", "did you mean allow_offload")
    assert_clear(lambda: PlannerOptions("highs"), PlanError, "keyword options only", "PlannerOptions(solver='highs'")
    assert PlannerOptions(zero_stages=[3, 1]).zero_stages == (3, 1)  # a list of stages is fine


# -- host memory and NVMe in cluster specs --------------------------------------------------------------

_DEL = object()


def _spec(drive=None, **group):  # type: ignore[no-untyped-def]
    """A one-group spec with host memory and NVMe; ``drive`` changes keys of its nvme mapping, ``group`` of
    the group (``_DEL`` removes a key)."""
    g = {"name": "g", "gpu": "A100-80GB", "gpus_per_node": 8, "intra_node": "nvswitch", "cpu_memory_gb": 1024,
         "nvme": {"capacity_tb": 3.84, "read_gbs": 6.8, "write_gbs": 4.0, **(drive or {})}}
    g.update(group)
    g["nvme"] = {k: v for k, v in g["nvme"].items() if v is not _DEL} if isinstance(g["nvme"], dict) else g["nvme"]
    return {"groups": [{k: v for k, v in g.items() if v is not _DEL}]}


CLUSTERS = [
    ("NVMe without host memory", _spec(cpu_memory_gb=_DEL), ("nvme is given without cpu_memory_gb",
                                                               "add cpu_memory_gb: <GiB per node>")),
    ("capacity 0", _spec({"capacity_tb": 0}), ("capacity_tb", "got 0", "decimal TB per node")),
    ("capacity negative", _spec({"capacity_tb": -1}), ("capacity_tb", "got -1", "plain number")),
    ("capacity with a unit", _spec({"capacity_tb": "3.8TB"}), ("capacity_tb", "'3.8TB'", "without units or quotes")),
    ("capacity missing", _spec({"capacity_tb": _DEL}), ("missing 'capacity_tb'", "add capacity_tb:")),
    ("read 0", _spec({"read_gbs": 0}), ("read_gbs", "got 0", "GB/s sequential read")),
    ("write nan", _spec({"write_gbs": float("nan")}), ("write_gbs", "got nan")),
    ("read inf", _spec({"read_gbs": float("inf")}), ("read_gbs", "got inf")),
    ("nvme path key", _spec({"path": "/mnt/nvme"}), ("unknown key 'path'", "allowed keys: capacity_tb")),
    ("nvme key typo", _spec({"capacity_gb": 3}), ("'capacity_gb'", "did you mean 'capacity_tb'")),
    ("nvme not a mapping", _spec(nvme="3.8TB"), ("nvme must be a mapping", "'3.8TB'")),
    ("host memory with a unit", _spec(cpu_memory_gb="512GB"), ("cpu_memory_gb", "'512GB'", "GiB of host memory")),
    ("host memory 0", _spec(cpu_memory_gb=0), ("cpu_memory_gb", "got 0")),
    ("host memory inf", _spec(cpu_memory_gb=float("inf")), ("cpu_memory_gb", "got inf")),
    ("GPU misspelt", _spec(gpu="H100-SMX"), ("'H100-SMX'", "did you mean 'H100-SXM'", "devices:")),
    ("GPU a number", _spec(gpu=100), ("gpu must be a type name, got 100", "add gpu:")),
    ("gpus_per_node 2.5", _spec(gpus_per_node=2.5), ("gpus_per_node", "2.5", "positive integer")),
]


@pytest.mark.parametrize("data, needles", [c[1:] for c in CLUSTERS], ids=[c[0] for c in CLUSTERS])
def test_cluster_tier_mistakes(data, needles) -> None:
    assert_clear(lambda: ClusterSpec.from_dict(data), ClusterSpecError, *needles)


def test_cluster_objects_built_in_python() -> None:
    assert_clear(lambda: NodeGroup.build(name="g", gpu="CPU", gpus_per_node=1, cpu_memory_bytes=2**30,
                                         nvme={"capacity_tb": 1}), ClusterSpecError,
                 "nvme must be an NvmeSpec or None, got dict")
    assert_clear(lambda: ClusterSpec(groups=None), ClusterSpecError, "got NoneType", "ClusterSpec.from_dict")


# -- make_plan: tiers, tiles and block names ------------------------------------------------------------


def _make(**kw):  # type: ignore[no-untyped-def]
    return lambda: make_plan(BLOCKS, **{"dp": 2, "global_batch": 8, "zero_stage": 3, **kw})


MAKE_PLAN = [
    ("tiers block typo", _make(tiers={"transformer.h0": ("cpu", "cpu")}),
     ("['transformer.h0']", "did you mean 'transformer.h.0'", "its blocks are")),
    ("tiers 'disk'", _make(tiers={"head": ("disk", "disk")}), ("tiers['head']", "'disk'", "'nvme'")),
    ("tiers 'ssd'", _make(tiers={"head": ("gpu", "ssd")}), ("'ssd'", "a disk tier is 'nvme'")),
    ("tiers 'host'", _make(tiers={"head": ("host", "host")}), ("'host'", "the host tier is 'cpu'")),
    ("tiers one string", _make(tiers={"head": "cpu"}), ("tiers['head'] = 'cpu'", "pair", "('cpu', 'cpu')")),
    ("tiers a list", _make(tiers=[("cpu", "cpu")]), ("tiers=[('cpu', 'cpu')]", "give a dict")),
    ("tiers (nvme, gpu)", _make(tiers={"head": ("nvme", "gpu")}), ("tiers['head']", "is not lowered",
                                                                   "set optimizer_tier to 'nvme' or 'cpu'")),
    ("stage-wide (nvme, gpu)", _make(param_tier="nvme"), ("make_plan()", "param_tier='nvme' with optimizer_tier='gpu'",
                                                          "set optimizer_tier")),
    ("stage-wide (cpu, gpu)", _make(param_tier="cpu"), ("param_tier='cpu' with optimizer_tier='gpu'",)),
    ("param_tier 'disk'", _make(param_tier="disk"), ("param_tier='disk'", "a disk tier is 'nvme'")),
    ("optimizer_tier 'SSD'", _make(optimizer_tier="SSD"), ("optimizer_tier='SSD'", "'nvme'")),
    ("zero_stage 4", _make(zero_stage=4), ("ZeRO stage 4", "0, 1, 2 or 3")),
    ("precision 'bf32'", _make(precision="bf32"), ("'bf32'", "did you mean 'fp32'")),
    ("schedule 'zigzag'", _make(schedule="zigzag"), ("'zigzag'", "'gpipe'")),
    ("dp 0", _make(dp=0), ("make_plan(dp=0)", "positive integer", "dp=2")),
    ("block names a string", lambda: make_plan("embed", global_batch=8), ("block_names='embed'", "a list of block")),
    ("global_batch -8", _make(global_batch=-8), ("global_batch=-8", "global_batch=8")),
    ("checkpoint names a missing block", _make(checkpoint=["transformer.h.9"]), ("checkpoint", "'transformer.h.9'")),
    ("activation_offload a string", _make(activation_offload="head"),
     ("activation_offload='head'", "a list of block names")),
    ("checkpoint_offload names a missing block", _make(checkpoint=True, checkpoint_offload=["h.1"]),
     ("checkpoint_offload", "['h.1']")),
    ("prefetch_depth 0", _make(tiers={"head": ("cpu", "cpu")}, prefetch_depth=0), ("prefetch_depth", "got 0",
                                                                                    "prefetch_depth=1")),
    ("tiles 0", lambda: BlockPlan(name="head", tiles=0), ("tiles must be an integer >= 1", "got 0", "tiles=1")),
    ("tiles -1", lambda: BlockPlan(name="head", tiles=-1), ("got -1", "tiles=4")),
    ("tiles 3.5", lambda: BlockPlan(name="head", tiles=3.5), ("got 3.5",)),
    ("tiles without ZeRO-3", lambda: dataclasses.replace(
        make_plan(BLOCKS, dp=2, global_batch=8).stages[0],
        blocks=(BlockPlan(name="head", tiles=2),)), ("tiles=2 needs ZeRO-3", "set zero_stage=3 or tiles=1")),
]


@pytest.mark.parametrize("fn, needles", [c[1:] for c in MAKE_PLAN], ids=[c[0] for c in MAKE_PLAN])
def test_make_plan_tier_mistakes(fn, needles) -> None:
    assert_clear(fn, PlanError, *needles)


def _estimate(config):  # type: ignore[no-untyped-def]
    spec = ClusterSpec.from_dict(_spec(gpu="CPU", gpus_per_node=4, intra_node="shm", cpu_memory_gb=16))
    return lambda: whalepy.estimate(tiny(), spec, config, **plan_kw())


ESTIMATE = [
    ("offload 'gpu'", _estimate({"dp": 4, "offload": "gpu"}), ("offload='gpu' is no offload", "'cpu' or 'nvme'")),
    ("offload 'ssd'", _estimate({"dp": 4, "offload": "ssd"}), ("offload='ssd'", "'cpu' or 'nvme'")),
    ("offload_params 'yes'", _estimate({"dp": 4, "offload": "nvme", "offload_params": "yes"}),
     ("offload_params='yes'", "True or False")),
    ("checkpoint_offload 'no'", _estimate({"dp": 4, "checkpoint": True, "checkpoint_offload": "no"}),
     ("checkpoint_offload='no'", "True or False")),
    ("checkpoint 'yes'", _estimate({"dp": 4, "checkpoint": "yes"}), ("checkpoint='yes'", "checkpoint=(2, 2)")),
    ("zero_stage True", _estimate({"dp": 4, "zero_stage": True}), ("got True", "zero_stage=3")),
    ("zero_offload without offload", _estimate({"dp": 4, "zero_offload": True}),
     ("zero_offload=True", "offload='cpu'")),
    ("zero_offload to nvme", _estimate({"dp": 4, "offload": "nvme", "zero_offload": True}),
     ("zero_offload=True", "offload='cpu'")),
]


@pytest.mark.parametrize("fn, needles", [c[1:] for c in ESTIMATE], ids=[c[0] for c in ESTIMATE])
def test_estimate_tier_mistakes(fn, needles) -> None:
    assert_clear(fn, PlanError, *needles)


def _tiers_in_file(p: str, o: str):  # type: ignore[no-untyped-def]
    def edit(d: dict) -> None:
        for b in d["stages"][0]["blocks"]:
            b["param_tier"], b["optimizer_tier"] = p, o
    return edit


@pytest.mark.parametrize("pair, needles", [
    (("cpu", "gpu"), ("block 'embed'", "param_tier='cpu' with optimizer_tier='gpu' is not lowered", "re-plan")),
    (("nvme", "gpu"), ("param_tier='nvme' with optimizer_tier='gpu'", "set optimizer_tier to 'nvme' or 'cpu'")),
    (("ssd", "gpu"), ("'ssd'", "a disk tier is 'nvme'")),
], ids=["(cpu, gpu)", "(nvme, gpu)", "ssd"])
def test_plan_file_with_a_tier_pair_the_runtime_does_not_lower(tmp_path: Path, pair, needles) -> None:
    from bad_input_cases import edited_plan_json

    path = edited_plan_json(tmp_path, _tiers_in_file(*pair))
    assert_clear(lambda: whalepy.Plan.load(path), PlanError, *needles)
    assert main(["show", path]) == 2  # and `whalepy show` says the same line


def test_tier_names_in_another_case_are_the_tier() -> None:
    plan = make_plan(BLOCKS, dp=2, global_batch=8, zero_stage=3, tiers={"head": ("CPU", " Cpu ")},
                     optimizer_tier="NVMe")
    tiers = {b.name: (b.param_tier, b.optimizer_tier) for b in plan.stages[0].blocks}
    assert tiers == {"embed": (Tier.GPU, Tier.NVME), "transformer.h.0": (Tier.GPU, Tier.NVME),
                     "transformer.h.1": (Tier.GPU, Tier.NVME), "head": (Tier.CPU, Tier.CPU)}


# -- parallelize(nvme_dir=...) and trace_memory ---------------------------------------------------------

_sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
_loss = lambda out, y: out.float().mean()  # noqa: E731


def _parallelize(plan=None, cluster=None, **kw):  # type: ignore[no-untyped-def]
    return lambda: whalepy.parallelize(tiny(), cluster or cluster4(), example_inputs=(TOKENS,), loss_fn=_loss,
                                       optimizer=_sgd, global_batch=kw.pop("global_batch", 8), plan=plan, **kw)


@pytest.mark.parametrize("kw, needles", [
    (dict(nvme_dir=5), ("nvme_dir=5 is a int", "nvme_dir='/local_nvme/whalepy'")),
    (dict(nvme_dir=["/tmp"]), ("nvme_dir=['/tmp'] is a list",)),
    (dict(nvme_keep="yes"), ("nvme_keep='yes'", "True", "False")),
], ids=["nvme_dir an int", "nvme_dir a list", "nvme_keep a string"])
def test_nvme_arguments(no_capture, kw, needles) -> None:
    assert_clear(_parallelize(**kw), ArgumentError, *needles)


@pytest.mark.parametrize("kw, needles", [
    (dict(max_grad_norm=1.0, clip_gradients=False), ("clip_gradients=False", "max_grad_norm=1.0", "drop clip_gradients")),
    (dict(clip_gradients=True), ("clip_gradients=True", "max_grad_norm=None", "drop clip_gradients")),
], ids=["clipping without clip_gradients", "clip_gradients without clipping"])
def test_clipping_and_the_planners_clip_option_disagree(no_capture, kw, needles) -> None:
    assert_clear(_parallelize(**kw), ArgumentError, *needles)


def _disk_plan(nvme_bytes: int = 0):  # type: ignore[no-untyped-def]
    plan = make_plan(BLOCKS, global_batch=4, optimizer_tier="nvme")
    stage = dataclasses.replace(plan.stages[0], cost=StageCost(nvme_state_bytes=nvme_bytes))
    return dataclasses.replace(plan, stages=(stage,))


def test_nvme_dir_refused_before_lowering(one_rank_launch) -> None:  # noqa: F811
    """Inside a launch: a file, or a drive without room for the plan's disk bytes (the files of every
    rank on its file system, summed: here the one rank), is refused before the model is lowered; nothing
    is created in the directory (the disk tier would create it)."""
    tmp = Path(one_rank_launch)
    one = ClusterSpec.local(1)
    afile = write(tmp, "afile", "x")
    for nvme_dir, plan, exc, needles in [
        (afile, _disk_plan(), ArgumentError, (repr(afile), "is a file, not a directory", "pass a directory")),
        (str(Path(afile) / "sub"), _disk_plan(), ArgumentError, ("is a file, not a directory",)),
        (str(tmp / "nvme"), _disk_plan(10**18), DiskSpaceError,
         (repr(str(tmp / "nvme")), "files of rank 0 (one file system) need 909494.70 TiB at their peak", "GiB free",
          "less a reserve of", "a directory on a drive with more room")),
    ]:
        model = tiny()
        before = {n: p.clone() for n, p in model.state_dict().items()}
        assert_clear(lambda: whalepy.parallelize(model, one, example_inputs=(TOKENS,), loss_fn=_loss,
                                                 optimizer=_sgd, global_batch=4, plan=plan, nvme_dir=nvme_dir),
                     exc, *needles)
        assert not (tmp / "nvme").exists()
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # not wrapped by FSDP2 / DDP
        assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


TRACE = [
    ("batch a list", lambda: trace_memory(tiny(), [[1, 2]]), WhalepyError,
     ("needs a batch", "got list", "torch.zeros(")),
    ("batch None", lambda: trace_memory(tiny(), None), WhalepyError, ("got NoneType",)),
    ("batch 0-d", lambda: trace_memory(tiny(), torch.tensor(1)), WhalepyError, ("got a 0-d tensor",)),
    ("batch too long", lambda: trace_memory(tiny(), torch.zeros(2, 64, dtype=torch.long), blocks={}), ArgumentError,
     ("whalepy.trace_memory()", "64 tokens", "at most 16")),
    ("empty batch", lambda: trace_memory(tiny(), torch.zeros(0, 8, dtype=torch.long)), ArgumentError,
     ("empty batch dimension", "at least one sample")),
    ("model a name", lambda: trace_memory("gpt2", TOKENS), WhalepyError, ("got str", "pass the built model")),
    ("loss_fn a name", lambda: trace_memory(tiny(), TOKENS, TOKENS, loss_fn="ce"), ArgumentError,
     ("loss_fn='ce'", "must be callable", "F.cross_entropy")),
    ("optimizer a factory", lambda: trace_memory(tiny(), TOKENS, optimizer=_sgd), ArgumentError,
     ("got function", "torch.optim.AdamW(model.parameters())")),
    ("blocks a string", lambda: trace_memory(tiny(), TOKENS, blocks="transformer.h.0"), ArgumentError,
     ("blocks='transformer.h.0'", "dict of block name -> list of module paths")),
    ("blocks name a missing module", lambda: trace_memory(tiny(), TOKENS, blocks={"b": ["transformer.h.9"]}),
     ArgumentError, ("['transformer.h.9']", "model.named_modules()")),
]


@pytest.mark.parametrize("fn, exc, needles", [c[1:] for c in TRACE], ids=[c[0] for c in TRACE])
def test_trace_memory_mistakes(fn, exc, needles) -> None:
    assert_clear(fn, exc, *needles)


# -- the command line -------------------------------------------------------------------------------------

MODEL = "bad_input_cases:tiny_model_and_inputs"
_NO_HOST = "groups:\n  - {name: g, gpu: CPU, gpus_per_node: 4, intra_node: shm,\n" \
           "     nvme: {capacity_tb: 1, read_gbs: 2, write_gbs: 1}}\n"
_UNIT = "groups:\n  - {name: g, gpu: CPU, gpus_per_node: 4, intra_node: shm, cpu_memory_gb: 16,\n" \
        "     nvme: {capacity_tb: 1TB, read_gbs: 2, write_gbs: 1}}\n"

CLI = [
    ("NVMe without host memory", lambda t: ["plan", MODEL, "--cluster", write(t, "c.yaml", _NO_HOST)],
     ("c.yaml", "nvme is given without cpu_memory_gb", "add cpu_memory_gb")),
    ("capacity with a unit", lambda t: ["estimate", MODEL, "--cluster", write(t, "c.yaml", _UNIT), "--dp", "4"],
     ("capacity_tb", "'1TB'", "without units or quotes")),
    ("--out in a missing directory", lambda t: ["plan", MODEL, "--cluster", CPU4, "--out", str(t / "no" / "p.json")],
     ("--out", "does not exist", "mkdir -p")),
    ("--out a directory", lambda t: ["plan", MODEL, "--cluster", CPU4, "--out", str(t)],
     ("is a directory", "plan.json")),
    ("--offload nvme without NVMe", lambda t: ["estimate", MODEL, "--cluster", CPU4, "--dp", "4", "--offload", "nvme"],
     ("offload to nvme", "no NVMe", "add nvme: {capacity_tb")),
    ("--offload cpu without host memory", lambda t: ["estimate", MODEL, "--cluster", CPU4, "--dp", "4", "--offload",
                                                     "cpu"], ("offload to cpu", "add cpu_memory_gb")),
    ("--zero-stages 1,,2", lambda t: ["plan", MODEL, "--cluster", CPU4, "--zero-stages", "1,,2"],
     ("--zero-stages 1,,2", "''", "0,1")),
    ("calibrate --disk-dir missing", lambda t: ["calibrate", "--quick", "--disk-dir", str(t / "no")],
     ("does not exist", "--disk-dir")),
    ("calibrate --disk-dir a file", lambda t: ["calibrate", "--quick", "--disk-dir", write(t, "f", "x")],
     ("is not a directory",)),
]


@pytest.mark.parametrize("argv, needles", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_command_line_tier_mistakes(tmp_path: Path, capsys, argv, needles) -> None:
    args = argv(tmp_path)
    assert main(args if args[0] == "calibrate" else [*args, "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[whalepy] error: "), err
    for needle in needles:
        assert needle in err[0], f"{needle!r} not in {err[0]!r}"


def test_checkpoint_offload_without_host_memory_is_said() -> None:
    """Asked for (it is off by default) where no group gives its host memory: the plan says it had no
    effect and what to add, rather than leaving it out silently."""
    plan = whalepy.plan(tiny(), cluster4(), **plan_kw(allow_checkpoint_offload=True))
    assert any("allow_checkpoint_offload=True had no effect" in n and "cpu_memory_gb" in n for n in plan.notes)
    assert not any("allow_checkpoint_offload" in n for n in whalepy.plan(tiny(), cluster4(), **plan_kw()).notes)


def test_nvme_dir_refused_before_planning(one_rank_launch, no_capture, monkeypatch) -> None:  # noqa: F811
    """Inside a launch, without a plan: a file or an unwritable directory is refused before the model is
    captured for planning (``no_capture``)."""
    import os

    tmp = Path(one_rank_launch)
    one = ClusterSpec.local(1)
    afile = write(tmp, "afile", "x")

    def call(nvme_dir):  # type: ignore[no-untyped-def]
        return lambda: whalepy.parallelize(tiny(), one, example_inputs=(TOKENS,), loss_fn=_loss, optimizer=_sgd,
                                           global_batch=4, nvme_dir=nvme_dir)

    assert_clear(call(afile), ArgumentError, "is a file, not a directory")
    locked = tmp / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real(p, mode))
    assert_clear(call(str(locked / "nvme")), ArgumentError, "is not writable", repr(str(locked)),
                 "pass a writable directory")
