"""print(plan) and plan.explain() show the key numbers."""

from __future__ import annotations

import re

from whalepy.ir.plan_text import format_rate, compress_names, compress_ranks
from whalepy.planner import plan_from_profile
from whalepy.planner.synthetic import transformer_profile

from planner_fixtures import a100, cluster, group


def test_compress() -> None:
    assert compress_names(["embed", "h.0", "h.1", "h.2", "head"]) == "embed, h.0-2, head"
    assert compress_ranks([0, 1, 2, 3, 8, 9, 11]) == "0-3,8-9,11"


def test_summary_shows_stages_and_totals() -> None:
    prof = transformer_profile(num_layers=24, hidden=2048, seq_len=1024, vocab=32000, num_heads=16)
    p = plan_from_profile(prof, a100(2), global_batch=64)
    text = str(p)
    assert text == p.summary()
    assert re.search(r"h\.\d+-\d+", text), text
    assert "A100-80GB x" in text
    assert f"{format_rate(p.cost.samples_per_s)} samples/s" in text, text
    assert "tokens/s" in text and "TFLOP/s per GPU" in text and "MFU" in text
    assert "MIP gap" in text and "solve time" in text
    assert "GiB" in text
    assert "Chosen:" in p.explain()


def test_mixed_summary_has_per_type_lines() -> None:
    prof = transformer_profile(num_layers=8, hidden=1024, seq_len=512, vocab=32000, num_heads=16)
    c = cluster(group("v", "V100-32GB", 4, 1, link="nvlink2"), group("t", "T4", 4, 1, link="pcie3"))
    p = plan_from_profile(prof, c, global_batch=64, max_microbatches=8)
    text = str(p)
    _check_per_type_lines(p, text)


def _check_per_type_lines(p, text: str) -> None:  # type: ignore[no-untyped-def]
    """Each GPU type's line gives, per stage it runs, the samples of a step that pass through its
    devices: all of them when the type holds the whole stage, its replicas' shares otherwise."""
    for name in set(p.rank_device_types):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"  {name}: stage"))
        for st in p.stages:
            replicas = [d for d in range(p.dp_degree) if st.device_types[d] == name]
            if not replicas:
                assert not re.search(rf"stages? [^:]*\b{st.index}\b[^:]*:", line), line
                continue
            n = sum(p.batch_shares[d] for d in replicas)
            want = f"all {n} samples" if len(replicas) == p.dp_degree else f"{n}/{p.global_batch} samples"
            assert want in line, (line, st.index, want)
        assert "idle" in line


def test_mixed_pipeline_by_type_and_mixed_replicas_per_type_lines() -> None:
    """One stage per GPU type (every sample passes both types) and replicas of mixed types in one
    stage (each type takes its share): the per-type lines say which."""
    prof = transformer_profile(num_layers=8, hidden=1024, seq_len=512, vocab=32000, num_heads=16)
    c = cluster(group("v", "V100-32GB", 4, 1, link="nvlink2"), group("t", "T4", 4, 1, link="pcie3"))
    by_type = plan_from_profile(prof, c, global_batch=64, max_microbatches=8)  # pp=2, a type per stage
    replicas = plan_from_profile(prof, c, global_batch=64, max_microbatches=1)  # pp=1 dp=8, 9 / 7 samples
    assert (by_type.pp_degree, replicas.pp_degree) == (2, 1), "the two layouts this test is about"
    assert len(set(replicas.batch_shares)) > 1
    for p in (by_type, replicas):
        _check_per_type_lines(p, str(p))
    assert "all 64 samples" in str(by_type) and "all 64 samples" not in str(replicas)


def test_explain_lines_of_alternatives_never_costed() -> None:
    """A pruned or disallowed alternative has no step time: its line gives the reason alone."""
    prof = transformer_profile(num_layers=8, hidden=1024, seq_len=512, vocab=32000, num_heads=16)
    c = cluster(group("v", "V100-32GB", 4, 1, link="nvlink2"), group("t", "T4", 4, 1, link="pcie3"))
    p = plan_from_profile(prof, c, global_batch=64, max_microbatches=8)
    lines = p.explain().splitlines()[1:]
    never = [a for a in p.alternatives if a.step_time_s == float("inf")]
    assert never, "this case records pruned / disallowed alternatives"
    for a in never:
        assert f"  {a.description}: {a.reason}" in lines
    assert not any(" - --" in ln or ": -" in ln for ln in lines), lines
