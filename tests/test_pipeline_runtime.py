"""Pipelined training on gloo/CPU matches one process: 3 AdamW steps of split_stages +
build_pipeline_schedule (GPipe, 1F1B, interleaved 1F1B) against the local model accumulating the same
micro-batches (parameters) and on the full batch (losses)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed
from test_stage_split import VOCAB, build_model, logits_of, loss_of, stage_paths
from whalepy import LaunchError, Schedule
from whalepy.runtime.pipeline import (
    build_pipeline_schedule,
    microbatch_mean_loss,
    run_pipeline_step,
    split_stages,
)

pytestmark = pytest.mark.distributed

BATCH, SEQ, STEPS = 8, 8, 3
# Adam divides by sqrt(v) + eps: with the default 1e-8, a parameter whose true gradient is zero (the
# attention key bias, to which softmax is invariant) is moved by +-lr on float rounding noise (~1e-11),
# which differs between any two summation orders. 1e-6 leaves every real gradient (>= 1e-5 here) alone.
ADAM = {"lr": 1e-2, "eps": 1e-6}
LAYOUTS = {2: [[0, 1, 2], [3, 4]], 4: [[0, 1], [2], [3], [4]]}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
         torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(STEPS)
    ]


def _reference(kind: str, num_microbatches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the same model and batches. The parameters are trained by gradient accumulation over
    the micro-batches the pipeline uses, with the pipeline's loss scaling: what a pipeline computes,
    summed in the same order. The losses are the full batch's at the same parameters, so the pipeline's
    summed micro-batch losses are also checked against the batch mean.

    Why not full-batch gradients as the parameter reference: their float rounding differs from the
    micro-batch sum by ~1e-9 absolute, and Adam turns a gradient element ``g`` with ``|g| <~ eps`` into an
    update ``lr * m / (sqrt(v) + eps)`` that moves by ``lr * dg / eps`` (times the bias correction) for a
    rounding difference ``dg``: 1e-2 * 2.4e-9 / 1e-6 * 0.5 = 1.2e-5, more than the 1e-5 tolerance. Which
    element happens to have such a tiny gradient depends on the initial weights (the transformers
    version's init) and on the CPU's kernels: with transformers 5.23 it is an entry of GPT-2's
    ``transformer.wte.weight`` (a token's single-position gradient component of 1.7e-7 in step 2), off
    by 0.93e-5 to 1.24e-5 depending on the machine. Summing in the pipeline's order removes that noise
    instead of widening the tolerance."""
    model, _ = build_model(kind)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    micro_loss = microbatch_mean_loss(loss_of, num_microbatches)
    losses = []
    for ids, targets in _batches():
        opt.zero_grad()
        with torch.no_grad():
            losses.append(loss_of(logits_of(model(ids)), targets).item())
        for mids, mtargets in zip(ids.chunk(num_microbatches), targets.chunk(num_microbatches)):
            micro_loss(logits_of(model(mids)), mtargets).backward()
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_pipelined(model, stages, schedule: str, num_microbatches: int) -> tuple[list, dict]:
    """3 AdamW steps through the schedule; return the step losses (None off the last stage) and this
    rank's parameters after them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_stages = len(stages)
    indices = list(range(rank, num_stages, world))  # round-robin: rank r holds r, r + world, ...
    local = [stages[i] for i in indices]
    micro_shape = (BATCH // num_microbatches, SEQ)
    pipe = build_pipeline_schedule(
        local, indices, num_stages=num_stages, schedule=Schedule(schedule),
        num_microbatches=num_microbatches, loss_fn=microbatch_mean_loss(loss_of, num_microbatches),
        group=None, device=torch.device("cpu"),
        example_microbatch=(torch.zeros(micro_shape, dtype=torch.long),),
    )
    opt = torch.optim.AdamW([p for s in local for p in s.parameters()], **ADAM)
    has_first, has_last = 0 in indices, num_stages - 1 in indices
    losses = []
    for ids, targets in _batches():
        opt.zero_grad()
        loss = run_pipeline_step(pipe, has_first, has_last, (ids,), targets)
        opt.step()
        losses.append(None if loss is None else loss.item())
    # the schedule keeps no micro-batch's output past its backward (run_pipeline_step steps it with
    # return_outputs=False where torch has it: the outputs are not used, the losses are)
    pipe_stages = getattr(pipe, "_stages", None) or [pipe._stage]
    if "return_outputs" in inspect.signature(pipe.step).parameters:
        assert all(not st.output_chunks for st in pipe_stages), "the schedule kept the step's outputs"
    return losses, {n: p.detach().clone() for s in local for n, p in s.named_parameters()}


def _pipelined_rank(kind: str, runs: list[tuple[str, int, int]]) -> dict:
    """On each rank: for every (schedule, stages, micro-batches), train the pipelined model from the
    same initial weights and compare with the single-process reference."""
    refs = {m: _reference(kind, m) for m in sorted({m for _, _, m in runs})}
    model, blocks = build_model(kind)  # same seed on every rank: same initial weights
    initial = copy.deepcopy(model.state_dict())
    out, split = {}, {}
    for schedule, num_stages, num_microbatches in runs:
        model.load_state_dict(initial)  # the stages hold the model's own parameters
        if (num_stages, num_microbatches) not in split:
            micro = torch.zeros(BATCH // num_microbatches, SEQ, dtype=torch.long)
            split[num_stages, num_microbatches] = split_stages(
                model, (micro,), None, stage_paths(blocks, LAYOUTS[num_stages]))
        stages = split[num_stages, num_microbatches]
        losses, params = _train_pipelined(model, stages, schedule, num_microbatches)
        ref_losses, ref_params = refs[num_microbatches]
        # allclose(rtol=1e-5, atol=1e-5) per element, reported as the worst excess over rtol
        excess = {n: ((p - ref_params[n]).abs() - 1e-5 * ref_params[n].abs()).max().item()
                  for n, p in params.items()}
        out[schedule, num_stages] = {"losses": losses, "excess": excess, "ref_losses": ref_losses}
    return {"all_names": sorted(ref_params), "runs": out}


def _check(results: list[dict]) -> None:
    for key in results[0]["runs"]:
        runs = [r["runs"][key] for r in results]
        step_losses = [r["losses"] for r in runs if r["losses"][0] is not None]
        assert len(step_losses) == 1, f"{key}: exactly one rank holds the last stage"
        want = runs[0]["ref_losses"]
        for got, ref in zip(step_losses[0], want):
            assert abs(got - ref) <= 1e-5 * abs(ref), f"{key}: losses {step_losses[0]} vs reference {want}"
        held = sorted(n for r in runs for n in r["excess"])
        assert held == results[0]["all_names"], f"{key}: every parameter is trained on exactly one rank"
        worst = max((d, n) for r in runs for n, d in r["excess"].items())
        assert worst[0] <= 1e-5, f"{key}: parameter {worst[1]} is off by {worst[0]:.2e} + 1e-5 * |ref|"


@pytest.mark.parametrize("kind", ["gpt", "gpt2", "llama"])
def test_gpipe_1f1b_interleaved_training_match_single_process(kind):
    """2 ranks: GPipe and 1F1B over 2 stages, interleaved 1F1B over 4 (2 virtual stages per rank)."""
    runs = [("gpipe", 2, 4), ("1f1b", 2, 4), ("interleaved_1f1b", 4, 4)]
    _check(run_distributed(_pipelined_rank, 2, kind, runs, timeout=180))


def test_four_ranks_one_stage_each():
    _check(run_distributed(_pipelined_rank, 4, "gpt", [("1f1b", 4, 4)], timeout=180))


def _bad_layout_rank() -> str:
    stages = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    stages[0].whalepy_input_shapes = ((2, SEQ),)  # what split_stages records
    micro = torch.zeros(2, SEQ, dtype=torch.long)
    rank = dist.get_rank()
    messages = []
    # both ranks claiming stage 0 (a rank holding stage 1 and the other stage 0 is a legal layout: the
    # stages are told which group rank holds which), then a micro-batch of the wrong shape
    for indices, example in (([0], (micro,)), ([rank], (micro[:1],))):
        try:
            build_pipeline_schedule(
                [stages[i] for i in indices], indices, num_stages=2, schedule=Schedule.GPIPE,
                num_microbatches=2, loss_fn=None, group=None, device=torch.device("cpu"),
                example_microbatch=example,
            )
        except LaunchError as e:
            messages.append(str(e))
    return "\n".join(messages)


def test_schedule_refuses_wrong_stage_layout_and_microbatch_shape():
    messages = run_distributed(_bad_layout_rank, 2, timeout=60)
    assert "held by exactly one rank" in messages[0]
    assert "micro-batch" in messages[0]


def test_microbatch_mean_loss_sums_to_the_batch_mean():
    logits = torch.randn(8, SEQ, VOCAB)
    targets = torch.randint(0, VOCAB, (8, SEQ))
    wrapped = microbatch_mean_loss(loss_of, 4)
    parts = [wrapped(lo, t) for lo, t in zip(logits.chunk(4), targets.chunk(4))]
    torch.testing.assert_close(sum(parts), loss_of(logits, targets))
