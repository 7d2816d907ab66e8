"""Pseudo-to-Real (whalepy.pseudo_to_real / whalepy.delink): tying, errors, what the profile, the
planner and the optimizer count (one process, and per rank under PP x DP), the exact meaning of "the first real step equals a step of the pseudo
model" in one process, and the same under PP 2 x DP 2 on 4 gloo processes against one process.

Tolerance: fp32, 1e-5 absolute on parameters and losses (the issue's figure). Parallel runs reorder
sums (data-parallel gradient averaging, micro-batches, the tied-copy gradient all-reduce), so they agree
with one process to rounding, about 1e-7 here; 1e-5 leaves room for that and nothing else.
"""

from __future__ import annotations

import copy

import pytest
import torch

import whalepy
from pseudo_cases import (
    NUM_LAYERS,
    as_shared,
    copy_model_and_optimizer,
    make_plans,
    pseudo_model,
    run_delink,
)
from runtime_cases import SEQ, adamw, batches, gpt_model, lm_loss

ATOL = 1e-5


def _layer_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.transformer.h[0].parameters())


# -- tying and its errors ------------------------------------------------------------------------------


def test_layers_share_the_first_layers_parameters():
    model = gpt_model(NUM_LAYERS)
    first = {n: p.detach().clone() for n, p in model.transformer.h[0].named_parameters()}
    real_count = sum(p.numel() for p in model.parameters())
    whalepy.pseudo_to_real(model, layers="transformer.h")
    layers = model.transformer.h
    for k in range(1, NUM_LAYERS):
        for (n, p), (_, q) in zip(layers[0].named_parameters(), layers[k].named_parameters()):
            assert p is q, n
    for n, p in layers[0].named_parameters():
        assert torch.equal(p, first[n])  # the shared weights are the first layer's
    shared = sum(p.numel() for p in model.parameters())
    assert shared == real_count - (NUM_LAYERS - 1) * _layer_numel(model)


@pytest.mark.parametrize("layers, message", [
    ("transformer.hh", "has no module 'transformer.hh'"),
    ("transformer.wte", "not an nn.ModuleList or nn.Sequential"),
])
def test_bad_layers_path_is_a_clear_error(layers, message):
    with pytest.raises(whalepy.AnnotationError, match=message):
        whalepy.pseudo_to_real(gpt_model(2), layers=layers)


def test_layers_of_different_shapes_are_refused():
    model = gpt_model(3)
    model.transformer.h[2].mlp.fc_in = torch.nn.Linear(32, 64)
    with pytest.raises(whalepy.AnnotationError, match=r"layer transformer.h.2 differs from transformer.h.0 "
                       r"\(parameter mlp.fc_in.weight of shape \[64, 32\]"):
        whalepy.pseudo_to_real(model)


def test_delink_of_a_model_that_is_not_pseudo_is_a_clear_error():
    with pytest.raises(whalepy.WhalepyError, match="not a pseudo model"):
        whalepy.delink(gpt_model(2))


# -- profile, planner, optimizer state: the shared weights count once ----------------------------------


def test_profile_and_planner_count_the_shared_weights_once():
    from whalepy.planner.space import build_segments

    model = pseudo_model()
    prof = whalepy.profile(model, (torch.zeros(2, SEQ, dtype=torch.long),))
    assert prof.total_params == sum(p.numel() for p in model.parameters())
    by_name = {b.name: b.num_params for b in prof.blocks}
    assert by_name["transformer.h.0"] == _layer_numel(model)
    assert all(by_name[f"transformer.h.{k}"] == 0 for k in range(1, NUM_LAYERS))
    # the planner's segments (blocks it treats as interchangeable) charge each block its own count
    charged = sum(seg.length * seg.block.num_params for seg in build_segments(prof))
    assert charged == prof.total_params
    # and the plan: on one A100 (ZeRO-0, nothing offloaded: offload is not what this checks) the stage holds 4 + 4 + 8 bytes per
    # parameter (fp32 master, gradient, AdamW moments; docs/runtime.md), of the shared set once
    one_gpu = whalepy.ClusterSpec.local(1, device_type="A100-80GB")
    stage = whalepy.plan_from_profile(prof, one_gpu, global_batch=8, time_limit_s=20, allow_offload=False).stages[0]
    assert (stage.zero_stage, stage.blocks[0].optimizer_tier) == (0, whalepy.Tier.GPU)
    assert stage.cost.optimizer_bytes == 8 * prof.total_params
    assert stage.cost.model_state_bytes == 16 * prof.total_params


def test_pseudo_models_optimizer_state_is_that_of_one_layer():
    """AdamW keeps two fp32 moments per parameter: the pseudo model's states are the non-layer
    parameters' plus ONE layer's; the real model's have every layer's."""
    x, y = batches(4, 1)[0]

    def state_bytes(model: torch.nn.Module) -> int:
        opt = adamw(model.parameters())
        lm_loss(model(x), y).backward()
        opt.step()
        return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                   if t.dim() > 0)  # the moments (not the scalar step count)

    pseudo, real = pseudo_model(), gpt_model(NUM_LAYERS)
    layer = _layer_numel(real)
    others = sum(p.numel() for n, p in real.named_parameters() if not n.startswith("transformer.h."))
    assert state_bytes(pseudo) == 2 * 4 * (others + layer)
    assert state_bytes(real) == 2 * 4 * (others + NUM_LAYERS * layer)


# -- the first real step, exactly --------------------------------------------------------------------


def _adamw_step(w, m, v, t, g, *, lr, betas, eps, weight_decay):
    """torch.optim.AdamW's update written out (Loshchilov & Hutter; the step count t after this step)."""
    b1, b2 = betas
    w = w * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = (v / (1 - b2 ** t)).sqrt() + eps
    return w - lr / (1 - b1 ** t) * m / denom


def test_first_real_step_is_the_pseudo_models_optimizer_step_per_layer():
    """After delinking: every layer equals the shared weights and holds the shared optimizer state;
    the first real step's loss is the pseudo model's loss on that batch; the layers' gradients sum to
    the pseudo model's gradient of the shared weights; and each layer's update is the pseudo model's
    optimizer step (its AdamW, from the shared moments and step count) applied with that layer's
    gradient."""
    data = batches(8, 3)
    pseudo = pseudo_model()
    opt = adamw(pseudo.parameters())
    for x, y in data[:2]:
        lm_loss(pseudo(x), y).backward()
        opt.step()
        opt.zero_grad()
    real, real_opt = copy_model_and_optimizer(pseudo, opt, adamw)
    whalepy.delink(real, optimizer=real_opt)
    assert whalepy.tools.pseudo_to_real.pseudo_layers(real) is None
    shared = dict(pseudo.named_parameters(remove_duplicate=False))
    shared_state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in pseudo.named_parameters()}
    for name, p in real.named_parameters():
        assert p is not shared[name] and torch.equal(p, shared[name]), name
        src = shared_state[as_shared(name)]
        for key, value in real_opt.state[p].items():
            assert torch.equal(value, src[key]), (name, key)
    assert len({id(p) for p in real.parameters()}) == len(dict(real.named_parameters()))

    x, y = data[2]
    pseudo_loss = lm_loss(pseudo(x), y)
    pseudo_loss.backward()
    real_loss = lm_loss(real(x), y)
    real_loss.backward()
    assert abs(real_loss.item() - pseudo_loss.item()) <= ATOL
    layer_names = [n for n, _ in pseudo.transformer.h[0].named_parameters()]
    for n in layer_names:
        summed = sum(real.get_parameter(f"transformer.h.{k}.{n}").grad for k in range(NUM_LAYERS))
        assert torch.allclose(summed, pseudo.get_parameter(f"transformer.h.0.{n}").grad, atol=ATOL), n

    hyper = {k: real_opt.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")}
    before = {n: p.detach().clone() for n, p in real.named_parameters()}
    real_opt.step()
    for name, p in real.named_parameters():
        s = shared_state[as_shared(name)]
        t = int(s["step"]) + 1
        want = _adamw_step(before[name], s["exp_avg"], s["exp_avg_sq"], t, p.grad, **hyper)
        assert torch.allclose(p.detach(), want, atol=ATOL), name
    # the layers part (each took its own gradient), and none took the pseudo model's own next step,
    # which applies the summed gradient
    h = [real.transformer.h[k].mlp.fc_in.weight for k in range(NUM_LAYERS)]
    assert all((h[0] - h[k]).abs().max() > 1e-4 for k in range(1, NUM_LAYERS))
    opt.step()
    w = pseudo.transformer.h[0].mlp.fc_in.weight
    assert all((h[k] - w).abs().max() > 1e-4 for k in range(NUM_LAYERS))


def test_meta_pseudo_model_delinks_to_a_meta_real_model():
    with torch.device("meta"):
        model = whalepy.pseudo_to_real(copy.deepcopy(gpt_model(2)).to("meta"))
    whalepy.delink(model)
    assert all(p.is_meta for p in model.parameters())
    assert model.transformer.h[0].mlp.fc_in.weight is not model.transformer.h[1].mlp.fc_in.weight


# -- DP x PP on 4 gloo processes against one process -------------------------------------------------


@pytest.mark.distributed
def test_delink_under_pp2_dp2_matches_one_process(tmp_path):
    from dist_harness import run_distributed

    plans = make_plans()
    results = run_distributed(run_delink, 4, *plans, str(tmp_path / "pseudo_ckpt"), timeout=600)
    # optimizer state per rank (AdamW: 8 bytes per parameter, sharded over the 2 replicas, no padding
    # at these shapes): the pseudo model's stages hold their other blocks and ONE layer each
    model = gpt_model(NUM_LAYERS)
    layer = _layer_numel(model)
    embed = sum(p.numel() for p in model.transformer.wte.parameters()) + model.transformer.wpe.weight.numel()
    head = model.lm_head.weight.numel() + sum(p.numel() for p in model.transformer.ln_f.parameters())
    pseudo_stage = {0: embed + layer, 1: layer + head}       # h.0, h.1 | h.2, h.3: one copy each
    real_stage = {0: embed + layer, 1: 3 * layer + head}     # h.0 | h.1, h.2, h.3
    seen: set[str] = set()
    for rank, r in enumerate(results):
        stage = next(s.index for s in plans[0].stages if any(rank in row for row in s.ranks))
        assert r["pseudo_state_bytes"] == 8 * pseudo_stage[stage] // 2, (rank, r)
        stage = next(s.index for s in plans[2].stages if any(rank in row for row in s.ranks))
        assert r["real_state_bytes"] == 8 * real_stage[stage] // 2, (rank, r)
        # each stage holds one copy of each shared tensor, its gradient summed over the two stages
        assert r["tied_copies"] == len(list(gpt_model(1).transformer.h[0].parameters())), (rank, r)
        assert r["pseudo_loss_err"] <= ATOL, (rank, r)
        # a plan for more devices than the job has: one clear error, naming where the state is
        assert r["too_big_error"].startswith("delink: the real model (55,488 parameters"), r
        assert "this job has 4 processes but the plan is for 8" in r["too_big_error"], r
        assert "pseudo_ckpt-big: relaunch" in r["too_big_error"], r
        # after delink: every layer's parameters (and the rest) equal the shared weights
        assert r["delinked_vs_shared"] <= ATOL, (rank, r)
        # the first real step: the pseudo model's loss, and the one-process real model's parameters
        assert r["first_real_vs_pseudo_loss"] <= ATOL, (rank, r)
        assert r["first_step_err"] <= ATOL, (rank, r)
        assert r["real_loss_err"] <= ATOL, (rank, r)  # and training continues
        # a checkpoint saved before delinking loads into the real model and gives the same step
        assert r["reloaded_vs_shared"] <= ATOL and r["again_err"] <= ATOL, (rank, r)
        assert r["again_loss_err"] <= ATOL, (rank, r)
        seen |= set(r["keys"])
    assert seen == set(results[0]["all_keys"])  # every tensor of the real model was checked
