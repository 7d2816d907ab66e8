"""``whalepy check`` on the full-size plans of issue 23 (tests/rank_check_cases.py), every rank role
lowered: the runtime's ``parallelize`` on the fake process group of the plan's world, the model on the
meta device at full width (GPT-3 175B's hidden size, heads and vocabulary; Llama-70B's, with
grouped-query attention), one whole training step on fake tensors.

The depth is cut (8 and 6 decoder layers, not 96 and 80) so that the three plans lower in CI time: a
rank's lowering costs about its blocks times the micro-batches (a 175B stage of 14 layers and 12
micro-batches: 9-20 s here, the first rank of a check 10 s more for the export of the whole model), and
depth repeats the same layer. Everything else is the full plan: the
1,024- and 64-rank worlds and their meshes, widths, micro-batches, batch shares, device types.
``benchmarks/bench_rank_check.py`` lowers the same plans at full depth (docs/benchmarks.md).

What each rank holds and moves is compared with the plan's prediction: model states exactly,
collectives within 1% (``rank_check.COLLECTIVE_RTOL``). FSDP2 gives replica ``r`` rows
``[r * ceil(n / dp), (r + 1) * ceil(n / dp))`` of a parameter of ``n`` rows (its TP-local first
dimension); the memory model charges the first replica's ``ceil(n / dp)`` rows (what must fit) and the
check predicts each rank's own replica. GPT-3's embedding (50,257 rows, run whole under TP: the
vocabulary divides by no TP degree) is the one parameter here whose rows do not divide.

A second one is fixed: a pipeline stage recomputes the rotary tables (glue of constants), and the
profile counted them in the embedding block's output, so the plan's send/receive bytes for Llama were
``1 + 2 * head_dim / hidden`` (3.1%) of what the stages send; values that depend on no input and no
parameter are no block's output now (passes/profile.py), and the messages match exactly.
"""

from __future__ import annotations

import pytest

from rank_check_cases import case
from whalepy.tools.rank_check import COLLECTIVE_RTOL, check_ranks, simulated

STATE_BYTES = 16
"""Bytes of model states per parameter element under bf16 mixed precision with AdamW (fp32 master weight and
gradient under FSDP2's reduce dtype, two fp32 Adam moments): what each plan here charges."""

VOCAB, HIDDEN = 50257, 12288


def _lower(name: str, layers: int, ranks: object = "roles"):  # type: ignore[no-untyped-def]
    c = case(name, layers)
    reports = check_ranks(c.plan.to_dict(), c.build, ranks=ranks, profile=c.profile, cluster=simulated(c.cluster))
    for rep in reports:
        assert rep.error is None and rep.collectives and rep.predicted_collectives, rep.lines()
        held = rep.layout
        assert {k: tuple(sorted(v)) for k, v in rep.meshes.items()} == {
            "dp": tuple(sorted(held.dp_group)), "tp": tuple(sorted(held.tp_group)), "pp": tuple(sorted(held.pp_group))}
    return c, reports


def _collectives_within(rep, skip: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    assert rep.collectives.keys() == rep.predicted_collectives.keys(), rep.lines()
    for kind, got in rep.collectives.items():
        if kind in skip:
            continue
        want = rep.predicted_collectives[kind]
        assert abs(got - want) <= COLLECTIVE_RTOL * want, (kind, rep.lines())


def _embedding_rows(replica: int, dp: int) -> int:
    """Rows of the embedding FSDP2 gives replica ``replica`` of ``dp`` (torch.chunk's split), counted here
    from the split's definition, not with the cost model's function."""
    per = -(-VOCAB // dp)
    return max(0, min(per, VOCAB - replica * per))


def test_gpt3_175b_on_1024_a100_every_role_lowers():
    """(a) pp 8 x dp 16 x tp 8, ZeRO-1 (lowered as FSDP2 without resharding), 12 micro-batches: the
    eight roles' representatives, rank 517 (stage 4, TP index 5), and the last replica of the first and
    of the last stage (ranks 127 and 1023, which hold fewer of the embedding's rows than the first)."""
    from whalepy.ir.rules import tp_local_params

    ranks = [0, 127, 128, 256, 384, 512, 517, 640, 768, 1023]
    c, reports = _lower("gpt3", 8, ranks)
    assert c.plan.world_size == 1024 and (c.plan.pp_degree, c.plan.dp_degree) == (8, 16)
    assert [r.layout.rank for r in reports] == ranks
    for rep in reports:
        assert rep.held_by_place == rep.predicted and rep.predicted["host"] == 0, rep.lines()
        _collectives_within(rep)
        assert rep.ok, rep.lines()
    by_rank = {r.layout.rank: r for r in reports}
    first, last = by_rank[0], by_rank[127]
    assert (first.layout.stage, first.layout.replica, last.layout.stage, last.layout.replica) == (0, 0, 0, 15)
    assert by_rank[517].layout.tp_index == 5 and by_rank[1023].layout.replica == 15
    # the plan charges the first replica's rows: the embedding's 3,142 of 50,257, not 50,257 / 16
    stage0 = c.plan.stages[0]
    even = STATE_BYTES * sum(tp_local_params(c.profile.block(n), 8) for n in stage0.block_names) / 16
    assert first.predicted["device"] == stage0.cost.model_state_bytes
    assert first.predicted["device"] - even == (_embedding_rows(0, 16) * 16 - VOCAB) * HIDDEN * STATE_BYTES / 16 \
        == 184_320
    # the last replica holds 15 rows fewer, and is predicted so
    rows = _embedding_rows(0, 16) - _embedding_rows(15, 16)
    assert rows == 15 and first.predicted["device"] - last.predicted["device"] == rows * HIDDEN * STATE_BYTES
    assert first.held_by_place["device"] - last.held_by_place["device"] == rows * HIDDEN * STATE_BYTES


def test_llama_70b_on_32_a100_and_32_l40s_every_role_lowers():
    """(b) pp 4 x dp 4 x tp 4, ZeRO-3, uneven stages and batch shares (40 on the A100 replicas, 24 on the
    L40S ones), one layer of each of the first two stages with its states in host memory: 8 roles
    (each stage on each device type), model states exact on the device and on the host, the data- and
    tensor-parallel collectives within 1%, the pipeline's messages the hidden states exactly, as predicted."""
    from whalepy.ir.plan import Tier

    c, reports = _lower("llama70b", 6)
    sizes = [len(s.blocks) for s in c.plan.stages]
    assert sizes == [3, 2, 2, 1] and c.plan.batch_shares == (40, 40, 24, 24)
    on_host = [sum(b.param_tier is Tier.CPU and b.optimizer_tier is Tier.CPU for b in s.blocks) for s in c.plan.stages]
    assert on_host == [1, 1, 0, 0]
    assert [rep.held_by_place["host"] > 0 for rep in reports] == [s < 2 for s in (r.layout.stage for r in reports)]
    assert sorted((r.layout.stage, r.layout.device_type) for r in reports) == sorted(
        (s, t) for s in range(4) for t in ("A100-80GB", "L40S"))
    h, seq, M = 8192, 4096, c.plan.num_microbatches
    for rep in reports:
        assert rep.held_by_place == rep.predicted and rep.predicted["device"] > 0, rep.lines()
        _collectives_within(rep, skip=("send_recv",))
        message = rep.layout.batch_share // M * seq * h * 2  # a micro-batch's hidden states in bf16
        ends = rep.layout.stage in (0, 3)
        assert rep.collectives["send_recv"] == (2 if ends else 4) * M * message, rep.lines()
        assert rep.predicted_collectives["send_recv"] == pytest.approx(rep.collectives["send_recv"], rel=1e-12)


def test_interleaved_stages_with_tied_embeddings_every_role_lowers():
    """(c) The GPT-3 shape with tied embeddings, pp 4 x 2 virtual stages x dp 32 x tp 8, ZeRO-3: the
    first and the last virtual stage hold the tied weight; the gradient sum over them and every other
    collective within 1%."""
    c, reports = _lower("interleaved", 6)
    assert c.plan.virtual_stages == 2 and len(reports) == 4
    assert reports[0].layout.chunks[0][0] == "embed" and reports[-1].layout.chunks[-1][-1] == "head"
    for rep in reports:
        assert rep.held_by_place == rep.predicted and rep.predicted["host"] == 0, rep.lines()
        _collectives_within(rep)
