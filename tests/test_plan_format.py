"""print(plan) and plan.explain() show the key numbers."""

from __future__ import annotations

import re

from whalepy._plan_format import _rate, compress_names, compress_ranks
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
    assert f"{_rate(p.cost.samples_per_s)} samples/s" in text, text
    assert "tokens/s" in text and "TFLOP/s per GPU" in text and "MFU" in text
    assert "MIP gap" in text and "solve time" in text
    assert "GiB" in text
    assert "Chosen:" in p.explain()


def test_mixed_summary_has_per_type_lines() -> None:
    prof = transformer_profile(num_layers=8, hidden=1024, seq_len=512, vocab=32000, num_heads=16)
    c = cluster(group("v", "V100-32GB", 4, 1, link="nvlink2"), group("t", "T4", 4, 1, link="pcie3"))
    p = plan_from_profile(prof, c, global_batch=64, max_microbatches=8)
    text = str(p)
    assert "T4: batch share" in text and "V100-32GB: batch share" in text and "idle" in text
