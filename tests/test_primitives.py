"""The four primitives as scopes and class decorators, their storage, and annotation resolution."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
import torch.nn as nn

from whalepy.errors import AnnotationError
from whalepy.primitives import (
    Cluster,
    Replicate,
    Split,
    _hook_installed,
    check_cluster_annotations,
    clear_annotations,
    cluster,
    module_annotations,
    replicate,
    resolve_annotations,
    split,
    stage,
)


def assert_error(fn, *needles: str) -> str:
    """``fn()`` raises AnnotationError with a one-line message holding ``needles`` and a fix."""
    with pytest.raises(AnnotationError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    assert "Fix" in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """embed, a stage holding split(4) mlp, then two single-block stages appended to a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        with stage(), split(4):
            self.mlp = MLP()
        self.blocks = nn.ModuleList()
        for _ in range(2):
            with stage():
                self.blocks.append(MLP())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mlp(self.embed(x))
        for block in self.blocks:
            x = block(x)
        return x


def nested(outer, inner) -> nn.Module:
    """``outer`` around ``block`` and ``inner`` around ``block.fc``."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with inner:
                self.fc = nn.Linear(4, 4)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with outer:
                self.block = Inner()

    return Outer()


# ----------------------------------------------------------------------------- annotation objects


def test_human_form_and_equality():
    assert str(split(4)) == "split(4)" and str(split()) == "split()"
    assert str(replicate(2)) == "replicate(2)" and str(replicate()) == "replicate()"
    assert str(cluster(gpu="V100-32GB")) == "cluster(gpu=V100-32GB)"
    assert str(cluster("A100-80GB", nodes=2, count=16)) == "cluster(gpu=A100-80GB, nodes=2, count=16)"
    assert str(cluster()) == "cluster()"
    s = stage()
    assert str(s) == f"stage#{s.ordinal}"
    assert split(4) == Split(4) and Split(4) != Replicate(4)
    assert stage() != stage() and stage().ordinal < stage().ordinal
    assert Cluster(gpu="T4", group="g0") == cluster("T4", group="g0")


@pytest.mark.parametrize(
    "make, needles",
    [
        (lambda: split(0), ["split(0)", "positive integer"]),
        (lambda: split(-2), ["split(-2)"]),
        (lambda: split(2.5), ["split(2.5)", "float"]),
        (lambda: split("4"), ["split('4')", "str"]),
        (lambda: replicate(0), ["replicate(0)"]),
        (lambda: replicate(True), ["replicate(True)", "bool"]),
        (lambda: Split(nn.Linear), ["split(Linear)", "@whalepy.split"]),
        (lambda: cluster(nodes=0), ["cluster(nodes=0)"]),
        (lambda: cluster(count=1.5), ["cluster(count=1.5)"]),
        (lambda: cluster(gpu=""), ["cluster(gpu='')"]),
        (lambda: cluster(group=3), ["cluster(group=3)"]),
        (lambda: stage(3), ["stage(3)", "no arguments"]),
    ],
)
def test_bad_arguments_raise_at_construction(make, needles):
    assert_error(make, *needles)


# -------------------------------------------------------------------------------------- scopes


def test_scope_form_tags_modules_assigned_inside_and_children_inherit():
    net = Net()
    got = resolve_annotations(net)
    assert list(got) == [name for name, _ in net.named_modules()]
    assert got[""].is_empty and got["embed"].is_empty and got["blocks"].is_empty
    for path in ("mlp", "mlp.fc1", "mlp.fc2"):
        assert (got[path].stage, got[path].split) == (0, 4)
    assert [got[p].stage for p in ("blocks.0", "blocks.0.fc2", "blocks.1", "blocks.1.fc1")] == [1, 1, 2, 2]
    assert got["mlp.fc1"].sources[0].startswith("stage#") and got["mlp.fc1"].sources[0].endswith(" on mlp")
    assert got["mlp.fc1"].sources[1] == "split(4) on mlp"


@pytest.mark.parametrize(
    "ann, field, value",
    [
        (replicate(2), "replicate", 2),
        (replicate(), "replicate", 0),
        (split(), "split", 0),
        (cluster("T4", group="g1", nodes=2, count=8), "cluster_group", "g1"),
    ],
)
def test_each_primitive_as_scope(ann, field, value):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            with ann:
                self.b = MLP()

    got = resolve_annotations(M())
    assert getattr(got["b.fc1"], field) == value and got["a"].is_empty
    assert module_annotations(M().b) == (ann,)


def test_modulelist_built_inside_scope_and_top_level_construction():
    with split(2):
        blocks = nn.ModuleList([MLP() for _ in range(3)])
    assert all(resolve_annotations(blocks)[f"{i}.fc1"].split == 2 for i in range(3))
    with stage():
        model = Net.__new__(Net)
        nn.Module.__init__(model)
        model.head = nn.Linear(2, 2)  # modules registered in the scope are tagged, the root is not
    assert resolve_annotations(model)["head"].stage == 0 and resolve_annotations(model)[""].stage is None


def test_hook_installed_only_while_a_scope_is_active():
    assert not _hook_installed()
    with split(2):
        assert _hook_installed()
        with stage():
            assert _hook_installed()
        assert _hook_installed()
    assert not _hook_installed()
    with pytest.raises(RuntimeError):
        with cluster("T4"):
            with replicate():
                raise RuntimeError("boom")
    assert not _hook_installed()
    tagged_after = nn.Sequential(nn.Linear(2, 2))
    assert module_annotations(tagged_after[0]) == ()


def test_scopes_are_per_thread():
    entered, built = threading.Event(), threading.Event()
    box = {}

    def other_thread() -> None:
        entered.wait()
        box["seq"] = nn.Sequential(nn.Linear(2, 2))
        built.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with split(8):
        entered.set()
        built.wait(timeout=10)
        mine = nn.Sequential(nn.Linear(2, 2))
    worker.join()
    assert module_annotations(box["seq"][0]) == ()
    assert module_annotations(mine[0]) == (Split(8),)
    assert not _hook_installed()


# ---------------------------------------------------------------------------------- decorators


@pytest.mark.parametrize(
    "decorate, field, value",
    [
        (split, "split", 0),
        (split(4), "split", 4),
        (Split(2), "split", 2),
        (replicate, "replicate", 0),
        (replicate(3), "replicate", 3),
        (cluster, "cluster_gpu", None),
        (cluster(gpu="T4"), "cluster_gpu", "T4"),
        (cluster(group="fast", nodes=2), "cluster_nodes", 2),
    ],
)
def test_decorator_with_and_without_parentheses(decorate, field, value):
    @decorate
    class Block(MLP):
        pass

    assert Block.__name__ == "Block" and isinstance(Block(), MLP)
    got = resolve_annotations(Block())
    assert getattr(got["fc2"], field) == value
    assert len(module_annotations(Block())) == 1
    assert not got[""].is_empty or field == "cluster_gpu"


@pytest.mark.parametrize("decorate", [stage, stage()])
def test_stage_decorator_gives_each_instance_its_own_stage(decorate):
    @decorate
    class Block(MLP):
        pass

    blocks = nn.Sequential(Block(), Block(), nn.Linear(8, 8), Block())
    got = resolve_annotations(blocks)
    assert [got[p].stage for p in ("0", "0.fc1", "1", "1.fc2", "2", "3")] == [0, 0, 1, 1, None, 2]


def test_decorated_class_in_a_scope_and_subclasses():
    @split(2)
    class Block(MLP):
        pass

    class Bigger(Block):
        pass

    with stage():
        holder = nn.ModuleList([Bigger()])
    anns = module_annotations(holder[0])
    assert [a.kind for a in anns] == ["stage", "split"]  # the scope encloses the class's own
    assert resolve_annotations(holder)["0.fc1"].split == 2


def test_decorating_something_else_raises():
    assert_error(lambda: split(4)(lambda x: x), "@split(4) decorates nn.Module subclasses")
    assert_error(lambda: replicate(int), "@replicate() decorates nn.Module subclasses")


# ------------------------------------------------------------------------------------- storage


def test_annotations_survive_deepcopy_meta_pickle_and_keep_state_dict():
    net = Net()
    expected = resolve_annotations(net)
    assert resolve_annotations(copy.deepcopy(net)) == expected
    assert resolve_annotations(pickle.loads(pickle.dumps(net))) == expected
    assert resolve_annotations(copy.deepcopy(net).to("meta")) == expected
    assert "_whalepy_annotations" in net.mlp.__dict__
    plain = Net()
    clear_annotations(plain)
    assert list(net.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(net.state_dict())


def test_torch_export_of_an_annotated_model():
    net = Net().eval()
    x = torch.randn(2, 8)
    program = torch.export.export(net, (x,), strict=False)
    torch.testing.assert_close(program.module()(x), net(x))
    assert resolve_annotations(net)["blocks.1"].stage == 2


def test_fully_shard_keeps_annotations():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs an uninitialised torch.distributed")
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        net = Net()
        expected = resolve_annotations(net)
        fully_shard(net.mlp)
        fully_shard(net)
        assert resolve_annotations(net) == expected
    finally:
        dist.destroy_process_group()


def test_clear_annotations():
    net = Net()
    assert clear_annotations(net) is net
    assert all(block.is_empty for block in resolve_annotations(net).values())


# ----------------------------------------------------------------------------------- resolution


@pytest.mark.parametrize(
    "outer, inner, needles",
    [
        (split(4), stage(), ["is nested inside split(4) on block", "cluster > stage"]),
        (replicate(2), stage(), ["stage#", "inside replicate(2) on block", "put stage() outside"]),
        (stage(), cluster("T4"), ["cluster(gpu=T4) on block.fc", "put cluster() outside stage()"]),
        (split(), cluster("T4"), ["cluster(gpu=T4) on block.fc", "inside split() on block"]),
        (replicate(), cluster(group="g"), ["cluster(group=g) on block.fc", "inside replicate()"]),
        (stage(), stage(), ["stages cannot nest", "on block.fc"]),
        (split(4), split(2), ["split(2) on block.fc", "inside split(4) on block", "agree on the degree"]),
        (replicate(8), replicate(4), ["replicate(4) on block.fc", "inside replicate(8)"]),
        (split(2), replicate(2), ["replicate(2) on block.fc", "put replicate() outside split()"]),
        (cluster("A100-80GB"), cluster("T4"), ["cluster(gpu=T4) on block.fc", "different gpu"]),
        (cluster(nodes=2), cluster(nodes=4), ["different nodes"]),
    ],
)
def test_contradictory_nesting_raises_with_path_and_fix(outer, inner, needles):
    model = nested(outer, inner)
    assert_error(lambda: resolve_annotations(model), *needles)


@pytest.mark.parametrize(
    "outer, inner",
    [
        (split(4), split(4)),
        (split(4), split()),
        (split(), split(2)),
        (replicate(2), replicate(2)),
        (replicate(2), split(4)),
        (stage(), replicate()),
        (cluster("T4"), stage()),
        (cluster("T4", nodes=2), cluster("T4")),
    ],
)
def test_allowed_nesting(outer, inner):
    got = resolve_annotations(nested(outer, inner))["block.fc"]
    assert got.sources[0].endswith(" on block")
    if outer == inner:  # the same value again is the same scope
        assert len(got.sources) == 1
    else:
        assert len(got.sources) == 2 and got.sources[1].endswith(" on block.fc")


def test_degrees_merge_and_cluster_fields_fill_from_outer():
    got = resolve_annotations(nested(split(), split(2)))["block.fc"]
    assert got.split == 2
    got = resolve_annotations(nested(cluster("T4", nodes=2), cluster("T4", count=4)))["block.fc"]
    assert (got.cluster_gpu, got.cluster_nodes, got.cluster_count) == ("T4", 2, 4)


def test_shared_module_resolves_per_path():
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    model["b"].__dict__["_whalepy_annotations"] = (split(2),)
    got = resolve_annotations(model)
    assert list(got) == ["", "a", "a.0", "b", "b.0"]
    assert got["a.0"].split is None and got["b.0"].split == 2


def test_stages_are_renumbered_in_module_order():
    late, early = stage(), stage()  # created in the reverse of module order
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].__dict__["_whalepy_annotations"] = (early,)
    model[2].__dict__["_whalepy_annotations"] = (late,)
    got = resolve_annotations(model)
    assert (got["0"].stage, got["1"].stage, got["2"].stage) == (0, None, 1)


def test_interleaved_stages_raise():
    first, second = stage(), stage()
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(3)))
    for i, s in enumerate((first, second, first)):
        model[i].__dict__["_whalepy_annotations"] = (s,)
    assert_error(lambda: resolve_annotations(model), f"{first} on 2 comes after {second} on 1", "contiguous")


def test_check_cluster_annotations():
    model = nested(cluster("V100-32"), replicate())
    got = resolve_annotations(model)
    message = assert_error(
        lambda: check_cluster_annotations(got, ["A100-80GB", "T4", "V100-32GB"], ["g0"]),
        "cluster(gpu='V100-32') on block:",
        "no GPU type 'V100-32' (it has A100-80GB, T4, V100-32GB); did you mean V100-32GB",
        "add a node group of that type",
    )
    assert "?." not in message
    assert_error(
        lambda: check_cluster_annotations(got, ["A100-80GB"], ["g0"]), "(it has A100-80GB)", "Fix the gpu="
    )
    check_cluster_annotations(got, ["V100-32"], [])
    grouped = resolve_annotations(nested(cluster(group="slow"), split()))
    assert_error(
        lambda: check_cluster_annotations(grouped, ["T4"], ["fast", "slow-t4"]),
        "cluster(group='slow') on block", "did you mean slow-t4?", "Fix the group=",
    )
    check_cluster_annotations(grouped, [], ["slow"])
