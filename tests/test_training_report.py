"""Training that reports itself: gradient clipping and ``evaluate`` under every layout against one
process, the step log and the plan log on rank 0 only, warnings once per job, and
``whalepy.trace_memory`` of a parallel model's step against one process at the same batch.

Clipping: ``max_grad_norm`` is small enough that every step clips, so the global norm whalepy
assembles (local shards, summed over sharded mesh dimensions and pipeline stages, tied copies once)
is what scales every update; per-step losses, the reported norms and the final parameters must match
the single-process run with ``torch.nn.utils.clip_grad_norm_`` (fp32: 1e-5, as the runtime tests).
``evaluate`` on a held-out batch before and after training matches the single-process eval-mode loss
and leaves the parameters exactly as they were.
"""

from __future__ import annotations

import logging
import re

import pytest

from dist_harness import run_distributed
from report_cases import MAX_NORM, run_cases
from runtime_cases import Case

pytestmark = pytest.mark.distributed

RTOL = 1e-5
ATOL = 1e-5


def _check(per_rank: list[list[dict]]) -> None:
    for rank, results in enumerate(per_rank):
        for r in results:
            assert r["min_ref_norm"] > MAX_NORM, r["name"]  # clipping engaged on every step
            for key, tol in (("loss_err", RTOL), ("norm_err", RTOL), ("eval_err", RTOL), ("param_err", ATOL)):
                assert r[key] <= tol, (r["name"], key, r[key])
            assert r["eval_changed_params"] == 0.0, r["name"]
            if r["traced"] is not None:  # trace_memory of a ParallelModel: the local iteration's
                local, single, phases = r["traced"]  # activations equal one process at that batch
                assert local == single and phases == ["backward", "forward", "optimizer"], (r["name"], r["traced"])
            steps = [x for x in r["log"] if re.match(r"whalepy: step \d+ \| loss [\d.]+ \| [\d.]+ m?s/step", x)]
            plan = [x for x in r["log"] if x.startswith("whalepy:   stage ")]
            if rank == 0:
                # 3 training steps, and the traced one where the case traces
                assert len(steps) == 3 + (r["traced"] is not None), (r["name"], r["log"])
                assert all("tokens/s" in x for x in steps), (r["name"], r["log"])
                assert len(plan) == r["stages"], (r["name"], r["log"])
            else:
                assert steps == [] and plan == [], (r["name"], rank, r["log"])


def test_two_ranks_clip_evaluate_and_logs():
    cases = [
        Case("gpt dp2 ddp", dp=2),
        Case("gpt dp2 zero1", dp=2, zero=1),
        Case("gpt dp2 zero3 2 micro-batches", dp=2, zero=3, microbatches=2),
        Case("gpt tp2", tp=2),
        Case("gpt pp2 1f1b", pp=2, microbatches=2),
        Case("hf tied pp2 (tied copies counted once)", kind="hf_tied", pp=2, microbatches=2),
    ]
    _check(run_distributed(run_cases, 2, cases, timeout=300))


def test_four_ranks_2d_clip_evaluate():
    cases = [
        Case("gpt dp2 x tp2 zero3 (2-D mesh shards)", dp=2, tp=2, zero=3),
        Case("gpt pp2 x dp2 zero2 interleaved", pp=2, dp=2, zero=2, virtual_stages=2, microbatches=2),
    ]
    _check(run_distributed(run_cases, 4, cases, timeout=300))


def test_warn_once_per_key_and_rank0_only(caplog):
    from whalepy.log import warn_once

    with caplog.at_level(logging.WARNING, logger="whalepy"):
        assert warn_once("test-key-unique", "whalepy: %s", "first")
        assert not warn_once("test-key-unique", "whalepy: %s", "second")
    assert [r.getMessage() for r in caplog.records] == ["whalepy: first"]


def test_bad_training_options_are_one_line_errors():
    import torch

    import whalepy
    from whalepy.errors import WhalepyError

    model = torch.nn.Linear(4, 4)
    for kw, word in (({"max_grad_norm": 0}, "max_grad_norm"), ({"max_grad_norm": "1"}, "max_grad_norm"),
                     ({"log_every": 0}, "log_every"), ({"log_every": 2.5}, "log_every")):
        with pytest.raises(WhalepyError, match=word):
            whalepy.parallelize(model, whalepy.ClusterSpec.local(2), example_inputs=(torch.zeros(2, 4),),
                                loss_fn=torch.nn.functional.mse_loss,
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), global_batch=4, **kw)
