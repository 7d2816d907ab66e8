"""Multi-process numerics of the lowered plans against one process, on CPU with gloo.

Each test spawns one group of processes and runs several layouts in it (process start-up costs
seconds). Every layout trains the GPT-style model of ``whalepy.models``, HF GPT-2 (untied, or tied as
by default) or HF Llama (GQA), dropout off, for 3 AdamW steps in fp32; per-step losses must match the
single-process run within 1e-5 relative and every parameter (both names of a tied one) within 1e-5
absolute. Plans use the front end's profile: its blocks and the tensor-parallel rules of its FX
pattern pass.
"""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from runtime_cases import Case, run_cases

pytestmark = pytest.mark.distributed

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def _check(results: list[list[dict]]) -> None:
    for per_rank in results:
        for r in per_rank:
            assert r["loss_err"] <= LOSS_RTOL, (r["name"], r)
            assert r["param_err"] <= PARAM_ATOL, (r["name"], r)
            if "load_err" in r:
                assert r["load_err"] <= PARAM_ATOL, (r["name"], r)
    names = [r["name"] for r in results[0]]
    assert len(names) == len(set(names))


def test_two_ranks_dp_tp_pp_zero_checkpointing():
    cases = [
        Case("gpt dp2 shares[3,5] zero0 (ddp)", dp=2, shares=(3, 5)),
        Case("gpt tp2", tp=2),
        Case("gpt dp2 zero1 (zero-redundancy optimizer)", dp=2, zero=1),
        Case("gpt dp2 zero2 2 micro-batches", dp=2, zero=2, microbatches=2),
        Case("gpt dp2 zero3 checkpointing 2 micro-batches", dp=2, zero=3, checkpoint=True,
             microbatches=2),
        Case("gpt pp2 1f1b", pp=2, microbatches=2),
        Case("gpt pp2 gpipe checkpointing", pp=2, microbatches=4, schedule="gpipe", checkpoint=True),
        Case("hf dp2 shares[3,5]", kind="hf", dp=2, shares=(3, 5)),
        Case("hf tp2 (conv1d, fused qkv)", kind="hf", tp=2),
        Case("hf pp2", kind="hf", pp=2, microbatches=2),
        Case("gpt pp2 x v2 interleaved 1f1b", pp=2, virtual_stages=2, microbatches=2),
        Case("hf tied pp2 (embedding/head copies, grads summed)", kind="hf_tied", pp=2, microbatches=2),
        Case("hf tied tp2 (vocab-parallel embedding = colwise head)", kind="hf_tied", tp=2),
        Case("hf tied dp2 zero3", kind="hf_tied", dp=2, zero=3),
        Case("llama tp2 (gqa)", kind="llama", tp=2),
        Case("llama pp2", kind="llama", pp=2, microbatches=2),
        # torch's multi-tensor AdamW, its default on CUDA (the loop is the CPU's): every wrapper's lists
        Case("gpt dp2 zero1 foreach", dp=2, zero=1, foreach=True),
        Case("gpt dp2 zero3 foreach", dp=2, zero=3, foreach=True),
        Case("hf tied pp2 foreach", kind="hf_tied", pp=2, microbatches=2, foreach=True),
    ]
    _check(run_distributed(run_cases, 2, cases, timeout=300))


def test_checkpoints_load_under_other_plans_and_back(tmp_path):
    """ZeRO-1 on DDP shards the optimizer state by parameter (ZeroRedundancyOptimizer); its save gathers
    each parameter's state from its owner, so the files are those of any plan (save refused before,
    and the planner chose ZeRO-1 for the 2-process example of docs/training.md, which checkpoints)."""
    cases = [
        ("resume", Case("gpt dp2 zero1", dp=2, zero=1), Case("gpt tp2", tp=2), str(tmp_path / "a")),
        ("resume", Case("hf tied pp2", kind="hf_tied", pp=2, microbatches=2),
         Case("hf tied dp2 zero1", kind="hf_tied", dp=2, zero=1), str(tmp_path / "b")),
        # tensor parallelism leaves norms plain beside DTensor shards: a multi-tensor step (CUDA's
        # default) steps them in separate groups (optimizer_impl.split_mixed_groups); the files still
        # load under a plan with one group, and back
        ("resume", Case("llama tp2 foreach", kind="llama", tp=2, foreach=True),
         Case("llama dp2", kind="llama", dp=2), str(tmp_path / "c")),
        ("resume", Case("gpt dp2", dp=2), Case("gpt tp2 foreach", tp=2, foreach=True), str(tmp_path / "d")),
    ]
    _check(run_distributed(run_cases, 2, cases, timeout=300))


def test_three_replicas_uneven_shares():
    cases = [
        Case("gpt dp3 shares[1,2,5] zero0 (ddp)", dp=3, shares=(1, 2, 5)),
        Case("gpt dp3 shares[1,2,5] zero3", dp=3, shares=(1, 2, 5), zero=3),
    ]
    _check(run_distributed(run_cases, 3, cases, timeout=240))


def test_four_ranks_2d_layouts_and_resume(tmp_path):
    cases = [
        Case("gpt dp2 x tp2", dp=2, tp=2),
        Case("gpt dp2 x tp2 zero3 checkpointing shares[3,5]", dp=2, tp=2, zero=3, checkpoint=True,
             shares=(3, 5)),
        Case("gpt pp2 x dp2 shares[2,6]", pp=2, dp=2, shares=(2, 6), microbatches=2),
        Case("gpt tp2 x pp2 foreach", tp=2, pp=2, microbatches=2, foreach=True),
        Case("hf dp2 x tp2", kind="hf", dp=2, tp=2),
        # a vocabulary TP 2 does not divide: embedding and head run whole on both TP ranks (the planner's
        # rule, ir.rules.tp_splits), their gradients equal there without a sync
        Case("gpt odd vocab dp2 x tp2 zero3 (embedding and head whole)", kind="gpt_odd", dp=2, tp=2, zero=3),
        Case("gpt dp2 x pp2 x v2 interleaved", dp=2, pp=2, virtual_stages=2, microbatches=2),
        Case("hf tied dp2 x pp2 zero3", kind="hf_tied", dp=2, pp=2, zero=3, microbatches=2),
        ("resume", Case("gpt dp2 x tp2", dp=2, tp=2), Case("gpt pp2 x dp2", pp=2, dp=2, microbatches=2),
         str(tmp_path / "gpt")),
        # tied embedding/head: one parameter under DP x TP, a copy per pipeline stage under PP x DP
        ("resume", Case("hf tied dp2 x tp2", kind="hf_tied", dp=2, tp=2),
         Case("hf tied pp2 x dp2 zero3", kind="hf_tied", pp=2, dp=2, zero=3, microbatches=2),
         str(tmp_path / "hf")),
    ]
    _check(run_distributed(run_cases, 4, cases, timeout=360))


def test_eight_ranks_3d():
    cases = [
        Case("gpt dp2 x tp2 x pp2 shares[2,6]", dp=2, tp=2, pp=2, shares=(2, 6), microbatches=2),
        Case("gpt dp2 x tp2 x pp2 zero3 checkpointing", dp=2, tp=2, pp=2, zero=3, checkpoint=True,
             microbatches=2, schedule="gpipe"),
    ]
    _check(run_distributed(run_cases, 8, cases, timeout=300))
