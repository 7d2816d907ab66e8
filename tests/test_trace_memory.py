"""whalepy.trace_memory: the warm-up iteration's memory timeline against what autograd and the
optimizer really hold, its activation bytes against the profile's estimate, and the planner taking
the trace in place of the estimate."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import whalepy
from whalepy.models import GPT, GPTConfig
from whalepy.frontend.trace import MemoryTrace, apply_memory_trace


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=64, num_layers=2, num_heads=4, hidden_size=64))


@pytest.fixture(scope="module")
def traced():
    model = _gpt()
    x = torch.randint(0, 256, (2, 64))
    opt = torch.optim.AdamW(model.parameters())
    trace = whalepy.trace_memory(model, x, x, loss_fn=_lm_loss, optimizer=opt)
    return model, x, opt, trace


def test_activation_bytes_equal_the_profile_for_gpt(traced):
    model, x, _, trace = traced
    prof = whalepy.profile(model, (x,))
    # the profile's rules are exact for this model (tests/test_cost_activations.py), so the measured
    # per-block bytes must equal the estimate, block by block
    assert trace.activation_bytes == {b.name: b.activation_bytes for b in prof.blocks}
    assert trace.block_order["forward"] == [b.name for b in prof.blocks]
    assert trace.block_order["backward"] == [b.name for b in reversed(prof.blocks)]


def test_timeline_follows_the_iteration(traced):
    model, _, opt, trace = traced
    phases = [e.phase for e in trace.events]
    # forward, then backward, then the optimizer, in that order
    assert phases.index("backward") > 0 and phases.index("optimizer") > phases.index("backward")
    assert phases[phases.index("optimizer"):] == ["optimizer"] * (len(phases) - phases.index("optimizer"))
    last_forward = max(i for i, p in enumerate(phases) if p == "forward")
    # at the end of forward the saved activations are alive
    assert trace.events[last_forward].live_bytes >= sum(trace.activation_bytes.values())
    # after step + zero_grad(set_to_none) what the iteration created and still holds is exactly the
    # optimizer's new state tensors
    state = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
             for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)}
    assert trace.events[-1].live_bytes == sum(state.values())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert trace.baseline_bytes >= params and trace.peak_bytes > trace.baseline_bytes
    assert sum(trace.block_param_bytes.values()) == params


def test_save_load_and_bad_file(traced, tmp_path):
    trace = traced[3]
    trace.save(tmp_path / "t.json")
    again = MemoryTrace.load(tmp_path / "t.json")
    assert again == trace
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(whalepy.WhalepyError, match="not a whalepy memory trace"):
        MemoryTrace.load(tmp_path / "bad.json")
    with pytest.raises(whalepy.WhalepyError, match="no such file"):
        MemoryTrace.load(tmp_path / "missing.json")


def test_planner_charges_the_measured_activations(traced):
    model, x, _, trace = traced
    x4 = torch.cat([x, x])
    prof = whalepy.profile(model, (x4,))
    # batch 2 traced, profile at batch 4: bytes scale with the batch
    scaled = apply_memory_trace(prof, trace)
    assert [b.activation_bytes for b in scaled.blocks] == [2 * trace.activation_bytes[b.name] for b in prof.blocks]
    # traced at the profile's batch (some saved tensors, such as position ids, do not scale with it):
    # measured == estimated for this model, so the plan is the same
    trace4 = whalepy.trace_memory(model, x4, x4, loss_fn=_lm_loss)
    cluster = whalepy.ClusterSpec.local(2)
    base = whalepy.plan_from_profile(prof, cluster, global_batch=8)
    same = whalepy.plan_from_profile(prof, cluster, global_batch=8, memory_trace=trace4)
    assert [s.cost.activation_bytes for s in same.stages] == [s.cost.activation_bytes for s in base.stages]
    assert any("memory_trace" in n for n in same.notes)
    heavier = dataclasses.replace(trace4, activation_bytes={k: 5 * v for k, v in trace4.activation_bytes.items()})
    more = whalepy.plan_from_profile(prof, cluster, global_batch=8, memory_trace=heavier,
                                     **{"zero_stages": (0,), "allow_checkpointing": False})
    less = whalepy.plan_from_profile(prof, cluster, global_batch=8, zero_stages=(0,), allow_checkpointing=False)
    assert max(s.cost.activation_bytes for s in more.stages) > max(s.cost.activation_bytes for s in less.stages)


def test_bad_inputs():
    with pytest.raises(whalepy.WhalepyError, match="nn.Module or a whalepy ParallelModel"):
        whalepy.trace_memory("model", torch.zeros(2, 3))
    with pytest.raises(whalepy.WhalepyError, match="scalar"):
        whalepy.trace_memory(torch.nn.Linear(3, 3), torch.zeros(2, 3))
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 3)
    with pytest.raises(whalepy.WhalepyError, match="materialise"):
        whalepy.trace_memory(meta, torch.zeros(2, 3))
    prof = whalepy.profile(_gpt(), (torch.randint(0, 256, (2, 64)),))
    alien = MemoryTrace(batch_size=2, device="cpu", baseline_bytes=0, activation_bytes={"nope": 1},
                        activation_dtype="float32")
    with pytest.raises(whalepy.WhalepyError, match="another model"):
        apply_memory_trace(prof, alien)
