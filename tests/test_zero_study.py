"""The ZeRO-stage study (``whalepy study zero``): built-in T5 / mT5 sizes, the predicted rows, and the
acceptance check that the prediction equals what the runtime holds and sends on 4 gloo processes."""

from __future__ import annotations

import csv
import sys

import pytest

from whalepy.models.t5 import T5_SIZES, T5Config, build_t5
from whalepy.tools.cli import main
from whalepy.cost_models.communication import CommGroup, Link, estimate_collective_link_bytes
from whalepy.tools.study import study_zero


def _t5_params(c: T5Config) -> int:
    """Parameters of a T5 v1.1 / mT5 counted from its published description (Raffel et al. 2020; Xue
    et al. 2021): shared embedding and untied head ``2 V d``; per encoder layer attention ``4 d (h d_kv)``,
    gated-GELU ``3 d d_ff`` and two RMS norms; per decoder layer a second attention and a third norm;
    one ``buckets x heads`` relative bias and a final norm per stack."""
    inner = c.num_heads * c.d_kv
    enc = 4 * c.d_model * inner + 3 * c.d_model * c.d_ff + 2 * c.d_model
    dec = 8 * c.d_model * inner + 3 * c.d_model * c.d_ff + 3 * c.d_model
    return 2 * c.vocab_size * c.d_model + c.num_layers * (enc + dec) + 2 * (c.num_buckets * c.num_heads + c.d_model)


@pytest.mark.parametrize("name,published", [("mt5-base", 580e6), ("mt5-large", 1.2e9), ("mt5-xl", 3.7e9),
                                            ("mt5-xxl", 13e9), ("t5-v1_1-xl", 3e9), ("t5-v1_1-xxl", 11e9)])
def test_builtin_t5_sizes_match_the_published_counts(name: str, published: float) -> None:
    model, (ids, dec) = build_t5(name, batch=1, seq_len=8)
    n = sum(p.numel() for p in model.parameters())
    assert n == _t5_params(T5_SIZES[name])
    # the papers round to two significant figures ("580M", "1.2B", "3.7B", "13B"; T5 "3B", "11B")
    assert n == pytest.approx(published, rel=0.06)
    assert ids.is_meta and dec.shape == (1, 8)


def test_prediction_rows_on_a_gpu_cluster() -> None:
    """mT5-base on 4 x 8 A100: the ZeRO ladder in memory and communication, and the offload rows."""
    rows = study_zero("mt5-base", "examples/clusters/a100_4x8.yaml", seq_len=128)
    by = {r.label: r for r in rows}
    assert list(by) == ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-2+cpu", "ZeRO-3+cpu"]
    states = [by[f"ZeRO-{z}"].model_state_bytes for z in range(4)]
    assert states[0] > states[1] > states[2] == states[3] > 0  # FSDP2 shards parameters at ZeRO-2 already
    P = rows[0].num_params
    assert states[0] == 16 * P  # fp32 parameters and gradients, Adam's two fp32 moments
    assert by["ZeRO-3+cpu"].model_state_bytes == 0 and by["ZeRO-3+cpu"].host_state_bytes == states[3]
    # ZeRO-3 gathers in forward and again in backward: one more all-gather than ZeRO-2
    assert by["ZeRO-3"].comm_bytes - by["ZeRO-2"].comm_bytes == pytest.approx(2 * P)  # bf16 all-gather
    assert by["ZeRO-1"].comm_bytes > by["ZeRO-0"].comm_bytes  # the post-step broadcast
    for r in rows:
        assert r.intra_node_bytes > r.inter_node_bytes > 0 and r.fits and r.samples_per_s > 0


def test_link_bytes_follow_the_hierarchy() -> None:
    fast, slow = Link(bandwidth=300e9, latency=1e-6), Link(bandwidth=100e9, latency=1e-5)
    one_node = CommGroup(ranks_per_node=8, num_nodes=1, intra=fast, inter=slow)
    four = CommGroup(ranks_per_node=8, num_nodes=4, intra=fast, inter=slow)
    n = 1e9
    assert estimate_collective_link_bytes("all_reduce", n, one_node) == (pytest.approx(2 * 7 / 8 * n), 0.0)
    intra, inter = estimate_collective_link_bytes("all_reduce", n, four)
    assert intra == pytest.approx(2 * 7 / 8 * n) and inter == pytest.approx(2 * 3 / 4 * n / 8)
    ag = estimate_collective_link_bytes("all_gather", n, four)
    assert ag == (pytest.approx(7 / 8 * n), pytest.approx(3 / 4 * n / 8))
    assert estimate_collective_link_bytes("reduce_scatter", n, four) == ag


CPU4_YAML = """groups:
  - {name: cpu, gpu: CPU, gpus_per_node: 4, nodes: 1, intra_node: shm, cpu_memory_gb: 16}
"""
"""Four CPU ranks on one node, with host memory so that the offload rows are included."""


def test_measured_matches_predicted_on_4_gloo_processes(tmp_path, capsys) -> None:
    """Acceptance: ``whalepy study zero`` on a small T5 on 4 gloo processes. Per rank, the model-state
    bytes held at the optimizer step equal the predicted ones within 1% (ZeroRedundancyOptimizer
    partitions whole tensors, so a rank's share may differ from ``P / d`` by part of one tensor), and
    the collective payload counted at the process group in one step matches the predicted volume within
    5% (FSDP2 pads each parameter's first dimension to a multiple of the dp degree, which the volume
    model does not count). The T5 here has no such padding, so both agree exactly in practice."""
    spec = tmp_path / "cpu4.yaml"
    spec.write_text(CPU4_YAML)
    out = tmp_path / "study.csv"
    # bf16: FSDP2 all-gathers 2 bytes per parameter but reduce-scatters 4, DDP all-reduces 4, so a wrong
    # element size for any collective shows (fp32 would send 4 for all of them)
    code = main(["study", "zero", "t5-tiny", "--cluster", str(spec), "--seq-len", "32", "--global-batch", "8",
                 "--precision", "bf16", "--measure", "--csv", str(out), "-q"])
    assert code == 0
    table = capsys.readouterr().out
    assert "meas. states" in table and "ZeRO-3+cpu" in table
    rows = list(csv.DictReader(out.open()))
    assert [(r["zero_stage"], r["offload"]) for r in rows] == [("0", ""), ("1", ""), ("2", ""), ("3", ""),
                                                                ("2", "cpu"), ("3", "cpu")]
    for r in rows:
        predicted_state = float(r["host_state_bytes"] if r["offload"] else r["model_state_bytes"])
        assert float(r["measured_state_bytes"]) == pytest.approx(predicted_state, rel=0.01), r
        assert float(r["measured_comm_bytes"]) == pytest.approx(float(r["comm_bytes"]), rel=0.05), r
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
            key = f"{kind}_bytes"
            if key in r:
                assert float(r[f"measured_{key}"] or 0) == pytest.approx(float(r[key] or 0), rel=0.05), (kind, r)
    assert float(rows[3]["measured_state_bytes"]) < float(rows[1]["measured_state_bytes"]) < float(
        rows[0]["measured_state_bytes"])
    P = int(rows[0]["num_params"])
    assert float(rows[2]["measured_all_gather_bytes"]) == 2 * P and float(rows[2]["measured_reduce_scatter_bytes"]) == 4 * P


def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    # --measure on GPUs is refused before anything is profiled
    assert main(["study", "zero", "mt5-xxl", "--cluster", "examples/clusters/a100_4x8.yaml", "--measure"]) == 2
    err = capsys.readouterr().err
    assert "--measure trains on CPU gloo processes" in err and len(err.strip().splitlines()) == 1
    assert main(["study", "zero", "--sizes", "mt5-huge", "--cluster", "examples/clusters/a100_4x8.yaml", "-q"]) == 2
    assert "unknown built-in model 'mt5-huge'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the [plot] extra were not installed
    import whalepy.tools.study

    def no_study(*a, **k):
        raise AssertionError("the study ran before the missing extra was found")

    monkeypatch.setattr(whalepy.tools.study, "study_zero", no_study)  # the check comes before any work
    code = main(["study", "zero", "t5-tiny", "--cluster", "examples/clusters/a100_4x8.yaml", "--seq-len", "16",
                 "--plot", str(tmp_path / "p.png"), "-q"])
    assert code == 2 and "pip install 'whalepy[plot]'" in capsys.readouterr().err
