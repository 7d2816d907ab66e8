"""Memory-centric tiling (``BlockPlan.tiles``, :mod:`whalepy.runtime.tiling`) of linears and embeddings:
tiled ZeRO-3 plans on 2 and 4 gloo ranks against the single-process untiled run, the FSDP2 units gathered during forward
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
from runtime_cases import PAD, Case, batches, build_model, case_profile
from tiling_cases import run_all
from whalepy.ir.tiling import tile_rows, tileable_modules
from whalepy.runtime._tile_state import merge_state, split_state
from whalepy.planner._tiling_costs import unit_params
from whalepy.runtime.tiling import TiledEmbedding, TiledLinear, tile_model, tiled_layout

TOL = 1e-5
NVME = {"param_tier": "nvme", "optimizer_tier": "nvme", "prefetch_depth": 2}
HOST = {"param_tier": "cpu", "optimizer_tier": "cpu", "prefetch_depth": 2}
Z3 = Case("z3", dp=2, zero=3)


def _tiled_paths(tiles: int) -> dict[str, dict[str, int]]:
    """Block -> {linear or embedding: tiles} as the runtime tiles the test model (``tileable_modules`` per block)."""
    model = build_model("gpt", 2)
    return {b.name: {n: tiles for n, _ in tileable_modules(model, b.modules)}
            for b in case_profile("gpt", 2).blocks if b.largest_linear_params}


def _largest_tile(tiles: int, block: str) -> int:
    """Parameters of the block's largest tile: ``ceil(out / tiles)`` rows of its largest linear."""
    model = build_model("gpt", 2)
    lins = tileable_modules(model, [block])
    return max(tile_rows(m.out_features, tiles)[0] * (m.in_features + (m.bias is not None)) for _, m in lins)


def test_tile_rows_follow_tensor_split():
    for out in (1, 7, 32, 128):
        for t in (1, 2, 3, 5):
            if t <= out:
                assert tile_rows(out, t) == [len(c) for c in torch.arange(out).tensor_split(t)]


def test_tiled_embedding_is_the_embedding_exactly():
    """Every id gets its one row (the other tiles add exact zeros) and the rows it does not select get
    exactly zero gradient: outputs and gradients bit for bit, a padding row wherever it falls."""
    for padding_idx in (None, 0, 21, 22, 63):
        for tiles in (2, 3, 7):
            torch.manual_seed(tiles)
            whole = torch.nn.Embedding(64, 8, padding_idx=padding_idx)
            model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(64, 8, padding_idx=padding_idx)})
            model["emb"].load_state_dict(whole.state_dict())
            assert tile_model(model, {"emb": tiles}) == 1 and isinstance(model["emb"], TiledEmbedding)
            ids = torch.cat([torch.arange(64), torch.randint(0, 64, (64,))]).view(4, 32)
            out, want = model["emb"](ids), whole(ids)
            assert torch.equal(out, want)
            grad = torch.randn_like(want)
            out.backward(grad)
            want.backward(grad)
            tiled = torch.cat([t.weight.grad for t in model["emb"].tiles])
            assert torch.equal(tiled, whole.weight.grad), (padding_idx, tiles)
            if padding_idx is not None:
                assert not tiled[padding_idx].any()  # the padding row: no gradient
                holders = [t.padding_idx for t in model["emb"].tiles if t.padding_idx is not None]
                assert len(holders) == 1  # one tile holds it, under its local index
            assert merge_state(dict(model.state_dict()), tiled_layout([model]))["emb.weight"].equal(whole.weight)


def test_tied_or_unusual_embeddings_are_not_tiled():
    """An embedding whose weight the LM head shares (HF GPT-2's default) is left out of the tileable
    modules, and its block (it shares a parameter with the head's) is refused by ``tiling_error``, so
    the planner never tiles it (``block_tiles``); a hand-written plan is refused in the 2-rank test.
    ``max_norm`` / ``scale_grad_by_freq`` / ``sparse`` embeddings stay whole."""
    from whalepy.ir.rules import tiling_error
    from whalepy.planner._tiling_costs import block_tiles

    tied = build_model("hf_tied", 2)
    embed = next(b for b in case_profile("hf_tied", 2).blocks if b.name == "embed")
    assert [n for n, _ in tileable_modules(tied, embed.modules)] == ["transformer.wpe"]
    assert embed.shares_params and block_tiles(embed, 4) == 1 and unit_params(embed, 4) == embed.num_params
    assert "shares a parameter" in tiling_error(4, zero=3, tp=1, shares_params=True)
    untied = next(b for b in case_profile("gpt", 2).blocks if b.name == "embed")
    assert untied.linear_rows == ((64, 32), (16, 32)) and block_tiles(untied, 4) == 4
    # the embedding's largest tile: ceil(64 / 3) = 22 rows of 32
    assert unit_params(untied, 3) == 22 * 32
    # what the runtime makes of a plan: the tied block refused before any lowering; a module of fewer
    # rows than the tiles (the 16 positions under tiles=20) split into one-row tiles
    from tiling_cases import tiled_plan
    from whalepy.errors import PlanError
    from whalepy.runtime.tiling import plan_tiling

    def modules(kind: str) -> dict:
        return {b.name: b.modules for b in case_profile(kind, 2).blocks}

    with pytest.raises(PlanError, match="block 'embed': tiles=2 on a block that shares a parameter"):
        plan_tiling(tied, tiled_plan(Case("tied", kind="hf_tied", dp=2, zero=3), 2), modules("hf_tied"))
    tiling = plan_tiling(build_model("gpt", 2), tiled_plan(Z3, 20), modules("gpt"))
    assert tiling["embed"] == {"transformer.wte": 20, "transformer.wpe": 16}
    assert set(tiling["transformer.h.0"].values()) == {20}
    odd = torch.nn.ModuleDict({"a": torch.nn.Embedding(8, 4, max_norm=1.0), "b": torch.nn.Embedding(8, 4, sparse=True),
                               "c": torch.nn.Embedding(8, 4, scale_grad_by_freq=True), "d": torch.nn.Embedding(8, 4)})
    assert [n for n, _ in tileable_modules(odd, [""])] == ["d"]


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


def test_meta_tiles_initialise_and_load_as_the_untiled_modules(tmp_path):
    """In one process: tiles (of linears and embeddings) of a meta model get the untiled model's initial
    weights (same seed), and read their rows of HF safetensors."""
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
    assert isinstance(model.transformer.wte, TiledEmbedding) and isinstance(model.transformer.wpe, TiledEmbedding)
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
        ("tiled_run", Case("t3 padding", kind="gpt_pad", dp=2, zero=3), 3, {}),
        ("refusal", Case("zero2", dp=2, zero=2), 2),
        ("refusal", Case("tp2", tp=2, zero=3), 2),
        ("refusal", Case("tied", kind="hf_tied", dp=2, zero=3), 2),
    ]
    per_rank = run_distributed(run_all, 2, items, timeout=600)
    t3, ckpt, actoff, nvme, host, offload, same, untiled, tiled, pad, zero2, tp2, tied = per_rank[0]
    for r in (t3, ckpt, actoff, nvme, host, offload, pad):
        assert r["kind"] == "fsdp2", r["name"]
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r
    # the padding token is in the data (its row: the local padding_idx 8 of the second of 3 tiles)
    assert any((x == PAD).any() for x, _ in batches(8, 3))
    # the disk tier homes the tiles' shards with their block (15 linears and 2 embeddings x 3 tiles x
    # weight, and bias where the linear has one)
    model = build_model("gpt", 2)
    assert nvme["tiles_in_nvme"] == sum(len(list(model.get_submodule(n).parameters()))
                                        for p in _tiled_paths(3).values() for n in p) * 3
    # prefetching with parameters on the host, 2 blocks ahead: a tiled block is prefetched by its own
    # unit and its first tile in forward (by the previous block's last tile), its own unit and last tile
    # in backward (by the next block's unit); the tiles after them are gathered one at a time
    h0, h1 = "transformer.h.0", "transformer.h.1"
    assert host["prefetch"][f"{h0}.mlp.fc_out.tiles.2"][0] == [
        h1, f"{h1}.attn.q_proj.tiles.0", "transformer.ln_f", "lm_head", "lm_head.tiles.0"]
    # (the tiled embedding block: its modules' units, and its last tile, the position embedding's)
    assert host["prefetch"][h1][1] == [h0, f"{h0}.mlp.fc_out.tiles.2", "transformer.wte", "transformer.wpe",
                                       "transformer.drop", "transformer.wpe.tiles.2"]
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
    # the embedding block is tiled too: its largest unit gathered is a 22-row tile of the token
    # embedding (not the 64-row table), what the planner charges for it
    prof_embed = next(b for b in case_profile("gpt", 2).blocks if b.name == "embed")
    embed_units = {n: size for n, size, _ in t3["units"] if n.startswith(("transformer.wte.", "transformer.wpe."))}
    assert embed_units == {"transformer.wte.tiles.0": 22 * 32, "transformer.wte.tiles.1": 21 * 32,
                           "transformer.wte.tiles.2": 21 * 32, "transformer.wpe.tiles.0": 6 * 32,
                           "transformer.wpe.tiles.1": 5 * 32, "transformer.wpe.tiles.2": 5 * 32}, embed_units
    assert unit_params(prof_embed, 3) == max(embed_units.values())
    for r in (same, untiled, tiled):
        assert r["keys"] == sorted(build_model("gpt", 2).state_dict()), r["name"]  # original names
        assert r["load_err"] <= TOL and r["param_err"] <= TOL and r["loss_err"] <= TOL, r
    # refused when the plan is made (StagePlan checks tiling_error), before parallelize builds anything
    assert zero2 == ("PlanError: stage 0, block 'embed': tiles=2 needs ZeRO-3 (tiles are gathered one at a "
                     "time), got ZeRO-2; set zero_stage=3 or tiles=1")
    assert tied == ("PlanError: block 'embed': tiles=2 on a block that shares a parameter with another block (a "
                    "tied weight, e.g. an embedding tied to the LM head) is not lowered: tiling would untie it; use "
                    "tiles=1 on this block")
    assert tp2 == ("PlanError: stage 0, block 'embed': tiles=2 with tensor parallelism (tp=2) is not "
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
