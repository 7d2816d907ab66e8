"""Memory-centric tiling (``BlockPlan.tiles``, :mod:`whalepy.runtime.tiling`): tiled ZeRO-3 plans on 2
and 4 gloo ranks against the single-process untiled run, the FSDP2 units gathered during forward
against the tile the planner charges, checkpoints between tiled and untiled plans, and the refusals.

Tolerances: fp32, 3 steps of AdamW, as the other runtime tests: losses 1e-5 absolute, weights 1e-5
absolute (summation order differs between a split and a whole GEMM and between sharded and whole
reductions; measured errors are 5e-7 for losses and 2e-6..5e-6 for weights).
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_harness import run_distributed
from runtime_cases import Case, build_model, case_profile
from tiling_cases import run_all
from whalepy._tiling import tileable_linears
from whalepy.runtime._tile_state import merge_state, split_state
from whalepy._tiling import tile_rows
from whalepy.planner._tiling_costs import unit_params
from whalepy.runtime.tiling import TiledLinear, tile_model, tiled_layout

TOL = 1e-5
NVME = {"param_tier": "nvme", "optimizer_tier": "nvme", "prefetch_depth": 2}
HOST = {"param_tier": "cpu", "optimizer_tier": "cpu", "prefetch_depth": 2}
Z3 = Case("z3", dp=2, zero=3)


def _tiled_paths(tiles: int) -> dict[str, dict[str, int]]:
    """Block -> {linear: tiles} as the runtime tiles the test model (``tileable_linears`` per block)."""
    model = build_model("gpt", 2)
    return {b.name: {n: tiles for n, _ in tileable_linears(model, b.modules)}
            for b in case_profile("gpt", 2).blocks if b.largest_linear_params}


def _largest_tile(tiles: int, block: str) -> int:
    """Parameters of the block's largest tile: ``ceil(out / tiles)`` rows of its largest linear."""
    model = build_model("gpt", 2)
    lins = tileable_linears(model, [block])
    return max(tile_rows(m.out_features, tiles)[0] * (m.in_features + (m.bias is not None)) for _, m in lins)


def test_tile_rows_follow_tensor_split():
    for out in (1, 7, 32, 128):
        for t in (1, 2, 3, 5):
            if t <= out:
                assert tile_rows(out, t) == [len(c) for c in torch.arange(out).tensor_split(t)]


def test_tiled_linear_computes_the_linear_and_state_keeps_original_names():
    model = build_model("gpt", 2)
    x = torch.randint(0, 64, (2, 16))
    want = model(x)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    n = tile_model(model, _tiled_paths(3)["transformer.h.0"])
    assert n == 6 and isinstance(model.get_submodule("transformer.h.0.mlp.fc_in"), TiledLinear)
    # rows split, outputs concatenated: the same values up to fp32 rounding of the smaller GEMMs
    torch.testing.assert_close(model(x), want, rtol=0, atol=1e-6)
    layout = tiled_layout([model])
    assert layout["transformer.h.0.mlp.fc_in"] == [43, 43, 42]
    merged = merge_state(dict(model.state_dict()), layout)
    assert set(merged) == set(plain) and all(torch.equal(merged[k], plain[k]) for k in plain)
    split = split_state(merged, dict(model.state_dict()), layout)
    assert set(split) == set(model.state_dict())


def test_meta_tiles_initialise_and_load_as_the_untiled_linears(tmp_path):
    """In one process: tiles of a meta model get the untiled model's initial weights (same seed), and
    read their rows of HF safetensors."""
    from safetensors.torch import save_file

    from whalepy.runtime.materialize import materialize, materialize_modules, snapshot

    def tiled_meta() -> tuple[torch.nn.Module, object]:
        with torch.device("meta"):
            model = build_model("gpt", 2)
        skeleton = snapshot(model)
        for paths in _tiled_paths(3).values():
            tile_model(model, paths)
        return model, skeleton

    with torch.device("meta"):
        plain = build_model("gpt", 2)
    materialize(plain, seed=3)
    want = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    model, skeleton = tiled_meta()
    materialize_modules([model], skeleton, "cpu", seed=3)
    got = merge_state(dict(model.state_dict()), tiled_layout([model]))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    source = {k: torch.randn_like(v) for k, v in want.items()}
    save_file(source, str(tmp_path / "model.safetensors"))
    model, skeleton = tiled_meta()
    materialize_modules([model], skeleton, "cpu", checkpoint=tmp_path / "model.safetensors")
    got = merge_state(dict(model.state_dict()), tiled_layout([model]))
    assert all(torch.equal(got[k], source[k]) for k in source)


@pytest.mark.distributed
def test_tiled_zero3_on_two_ranks_matches_single_process(tmp_path):
    items = [
        ("tiled_run", Case("t3", dp=2, zero=3), 3, {}),
        ("tiled_run", Case("t2 checkpoint", dp=2, zero=3, checkpoint=True), 2, {}),
        ("tiled_run", Case("t2 activation offload", dp=2, zero=3, extra={"activation_offload": True}), 2, {}),
        ("tiled_run", Case("t3 nvme", dp=2, zero=3, extra=NVME), 3, {}, str(tmp_path)),
        ("tiled_run", Case("t3 cpu depth 2", dp=2, zero=3, extra=HOST), 3, {}),
        ("tiled_run", Case("t2 zero-offload", dp=2, zero=3, extra={"optimizer_tier": "cpu"}), 2, {}),
        ("resume_run", (Z3, 3), (Z3, 3), os.path.join(tmp_path, "same")),
        ("resume_run", (Z3, 3), (Z3, 1), os.path.join(tmp_path, "to-untiled")),
        ("resume_run", (Z3, 1), (Z3, 2), os.path.join(tmp_path, "to-tiled")),
        ("refusal", Case("zero2", dp=2, zero=2), 2),
        ("refusal", Case("tp2", tp=2, zero=3), 2),
    ]
    per_rank = run_distributed(run_all, 2, items, timeout=600)
    t3, ckpt, actoff, nvme, host, offload, same, untiled, tiled, zero2, tp2 = per_rank[0]
    for r in (t3, ckpt, actoff, nvme, host, offload):
        assert r["kind"] == "fsdp2", r["name"]
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r
    # the disk tier homes the tiles' shards with their block (15 linears x 3 tiles x weight + bias)
    assert nvme["tiles_in_nvme"] == sum(2 if n != "lm_head" else 1 for p in _tiled_paths(3).values()
                                        for n in p) * 3
    # prefetching with parameters on the host, 2 blocks ahead: a tiled block is prefetched by its own
    # unit and its first tile in forward (by the previous block's last tile), its own unit and last tile
    # in backward (by the next block's unit); the tiles after them are gathered one at a time
    h0, h1 = "transformer.h.0", "transformer.h.1"
    assert host["prefetch"][f"{h0}.mlp.fc_out.tiles.2"][0] == [
        h1, f"{h1}.attn.q_proj.tiles.0", "transformer.ln_f", "lm_head", "lm_head.tiles.0"]
    assert host["prefetch"][h1][1] == [h0, f"{h0}.mlp.fc_out.tiles.2", "transformer.wte", "transformer.wpe",
                                       "transformer.drop"]
    # working set: inside a tiled block the largest FSDP2 unit gathered is one tile, and what is
    # gathered at once is that tile plus the block's own parameters (its layer norms: 128)
    for r, tiles in ((t3, 3), (ckpt, 2)):
        inside = [(n, size, together) for n, size, together in r["units"] if n.startswith("transformer.h.0.")]
        assert max(size for _, size, _ in inside) == _largest_tile(tiles, "transformer.h.0"), inside
        block = next(size for n, size, _ in r["units"] if n == "transformer.h.0")
        assert block == 128
        # what the planner charges as the block's FSDP2 unit is the largest unit the runtime gathered
        prof_block = next(b for b in case_profile("gpt", 2).blocks if b.name == "transformer.h.0")
        assert unit_params(prof_block, tiles) == max(size for _, size, _ in inside)
        assert max(t for _, _, t in inside) == block + _largest_tile(tiles, "transformer.h.0")
    for r in (same, untiled, tiled):
        assert r["keys"] == sorted(build_model("gpt", 2).state_dict()), r["name"]  # original names
        assert r["load_err"] <= TOL and r["param_err"] <= TOL and r["loss_err"] <= TOL, r
    # refused when the plan is made (StagePlan checks tiling_error), before parallelize builds anything
    assert zero2 == ("PlanError: stage 0, block 'transformer.h.0': tiles=2 needs ZeRO-3 (tiles are gathered one at a "
                     "time), got ZeRO-2; set zero_stage=3 or tiles=1")
    assert tp2 == ("PlanError: stage 0, block 'transformer.h.0': tiles=2 with tensor parallelism (tp=2) is not "
                   "lowered; use tp=1 or tiles=1")


@pytest.mark.distributed
def test_tiled_zero3_on_four_ranks_pipeline_and_meta_init(tmp_path):
    pp = Case("pp2 dp2", pp=2, dp=2, zero=3, microbatches=2, schedule="gpipe")
    items = [
        ("tiled_run", Case("dp4 t3", dp=4, zero=3), 3, {}),  # 43-row tiles on 4 ranks: 11, 11, 11, 10
        ("tiled_run", pp, 2, {}),
        ("meta_run", Case("meta dp4 t3", dp=4, zero=3), 3, 2, os.path.join(tmp_path, "meta")),
        ("resume_run", (pp, 2), (Case("dp4", dp=4, zero=3), 3), os.path.join(tmp_path, "pp-to-dp")),
    ]
    per_rank = run_distributed(run_all, 4, items, timeout=600)
    dp3, pipe, meta, resume = per_rank[0]
    for r in (dp3, pipe):
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r
    # a meta model's tiles are initialised as the untiled linear under the same seed, then sliced
    assert meta["init_err"] == 0.0
    assert meta["checkpoint_err"] == 0.0  # tiles 3 -> a meta model with tiles 2: a copy
    assert meta["loss_err"] <= TOL and meta["param_err"] <= TOL, meta
    assert resume["load_err"] <= TOL and resume["param_err"] <= TOL and resume["loss_err"] <= TOL, resume
