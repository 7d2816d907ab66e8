"""The Hugging Face zoo as a test matrix (issue 22): tiny random-weight models of many architectures,
each trained under several layouts on 4 gloo ranks and compared with one process (no tests here).

Every rank runs every case in turn inside ONE process group (spawning 4 interpreters and importing
transformers costs seconds; a case costs a fraction of one). Per case, each rank:

1. builds the tiny model from its ``Config`` class (seeded, dropout off, fp32, eager attention);
2. trains a copy in this process alone (the reference) with plain SGD;
3. lowers the layout's plan with ``parallelize`` and trains the same steps on the same batches;
4. reports the per-step losses and the largest parameter difference after the steps, or the
   ``WhalepyError`` that refused the case (its class and one-line message), or any other exception
   (which the test reports as a failure: a raw traceback is a bug).

Why SGD and not Adam for the parameter comparison: Adam divides each update by the root of the second
moment, so a parameter whose gradient is near zero (a padding row, a bias the loss barely reaches)
moves by ``lr * g / (sqrt(g^2) + eps)``, about ``lr * sign(g)`` however tiny ``g`` is; a round-off
difference of 1e-9 between an all-reduced and a local gradient then becomes a 1e-3 difference in the
parameter. SGD moves it by ``lr * g``, so parameters differ by ``lr`` times the gradients' round-off, and
a wrong gradient (a mis-sharded weight) still shows as a large difference.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
CPU4 = str(ROOT / "examples" / "clusters" / "cpu4.yaml")
VOCAB = 128
SEQ = 8
GLOBAL_BATCH = 8
STEPS = 2
LR = 0.5

ARCHS = ("gpt2", "llama", "mistral", "qwen2", "gemma2", "gpt_neox", "opt", "phi", "phi3", "falcon",
         "mixtral", "bert", "t5", "vit", "whalepy_gpt", "whalepy_t5")
LAYOUTS = ("dp2xtp2", "pp2xdp2", "zero3", "tp2xpp2", "planner")


# -- models -------------------------------------------------------------------------------------------

_DECODER_KW = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                   tie_word_embeddings=False, attention_dropout=0.0)


def _hf(cls_name: str, cfg_name: str, **kw: Any) -> Callable[[], Any]:
    """A builder of ``transformers.<cls_name>`` from ``<cfg_name>(**kw)`` with eager attention."""
    def build() -> Any:
        import transformers

        cfg = getattr(transformers, cfg_name)(**kw)
        cfg._attn_implementation = "eager"
        return getattr(transformers, cls_name)(cfg)
    return build


def _causal(cls_name: str, cfg_name: str, **kw: Any) -> Callable[[], Any]:
    return _hf(cls_name, cfg_name, **{**_DECODER_KW, **kw})


_NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)
_gpt2 = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
_opt = _hf("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
           num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0,
           attention_dropout=0.0)
_falcon = _hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, **_NO_DROPOUT)
_gpt_neox = _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                tie_word_embeddings=False, **_NO_DROPOUT)
_phi = _hf("PhiForCausalLM", "PhiConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, max_position_embeddings=32, resid_pdrop=0.0, embd_pdrop=0.0,
           attention_dropout=0.0)
_bert = _hf("BertForMaskedLM", "BertConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
_t5 = _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2,
          num_decoder_layers=2, num_heads=4, dropout_rate=0.0)
_vit = _hf("ViTForImageClassification", "ViTConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=64, image_size=16, patch_size=8, num_labels=VOCAB, hidden_dropout_prob=0.0,
           attention_probs_dropout_prob=0.0)


def _whalepy_gpt() -> Any:
    from whalepy.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, num_layers=2, num_heads=4, hidden_size=32))


def _whalepy_t5() -> Any:
    from whalepy.models.t5 import T5, T5Config

    return T5(T5Config(d_model=32, d_ff=64, num_heads=4, d_kv=8, num_layers=2, vocab_size=VOCAB))


BUILDERS: dict[str, Callable[[], Any]] = {
    "gpt2": _gpt2,
    "llama": _causal("LlamaForCausalLM", "LlamaConfig"),
    "mistral": _causal("MistralForCausalLM", "MistralConfig", sliding_window=None),
    "qwen2": _causal("Qwen2ForCausalLM", "Qwen2Config"),
    "gemma2": _causal("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, query_pre_attn_scalar=8,
                      tie_word_embeddings=True),
    "gpt_neox": _gpt_neox,
    "opt": _opt,
    "phi": _phi,
    "phi3": _causal("Phi3ForCausalLM", "Phi3Config", pad_token_id=0),
    "falcon": _falcon,
    "mixtral": _causal("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                       router_jitter_noise=0.0),
    "bert": _bert,
    "t5": _t5,
    "vit": _vit,
    "whalepy_gpt": _whalepy_gpt,
    "whalepy_t5": _whalepy_t5,
}


def _gpt_v50257() -> Any:
    """whalepy's GPT with GPT-2's vocabulary, its layers annotated ``split(2)``: the planner must put the
    50257-token embedding (not divisible by 2) in a stage with TP 2, where it runs whole."""
    import whalepy
    from whalepy.models import GPT, GPTConfig
    from whalepy.models.zoo import GPT2_VOCAB

    model = GPT(GPTConfig(vocab_size=GPT2_VOCAB, block_size=32, num_layers=2, num_heads=4, hidden_size=32))
    return whalepy.annotate(model, {"transformer.h.*": whalepy.split(2)})


BUILDERS["gpt_v50257"] = _gpt_v50257


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = BUILDERS[arch]()
    return model.train()


def batches(arch: str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """``STEPS`` global batches ``(inputs, targets)``, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        def tokens(n: int = SEQ) -> torch.Tensor:
            return torch.randint(1, VOCAB, (GLOBAL_BATCH, n), generator=g)

        if arch == "vit":
            x = (torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g),)
            y = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=g)
        elif arch == "t5":  # HF T5's forward: (input_ids, attention_mask, decoder_input_ids)
            x = (tokens(), torch.ones(GLOBAL_BATCH, SEQ, dtype=torch.long), tokens())
            y = tokens()
        elif arch == "whalepy_t5":
            x, y = (tokens(), tokens()), tokens()
        else:
            x, y = (tokens(),), tokens()
        out.append((x, y))
    return out


def loss_fn(out: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def reference(arch: str, data: list) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    """Losses, state and parameter names after training ``arch`` in this process alone."""
    model = build(arch)
    opt = sgd(model.parameters())
    losses = []
    for x, y in data:
        loss = loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return (losses, {k: v.detach().clone() for k, v in model.state_dict().items()},
            sorted(n for n, _ in model.named_parameters()))


# -- plans --------------------------------------------------------------------------------------------


def layout_plan(layout: str, prof: Any) -> Any:
    """The plan of ``layout`` for 4 ranks: a fixed layout through ``make_plan`` with the TP rules the
    planner would put in it (those of the blocks that split at that degree), or the planner's own."""
    from whalepy.ir.rules import tp_splits
    from whalepy import ClusterSpec
    from whalepy.planner import plan_from_profile
    from whalepy.runtime import make_plan

    if layout == "planner":
        # solved on rank 0 and sent to the others, as parallelize(plan=None) does (CI time: four ranks
        # solving the same ILP on two cores cost four solves)
        from whalepy.runtime._pm_setup import _plan_once

        return _plan_once(lambda: plan_from_profile(prof, ClusterSpec.load(CPU4), global_batch=GLOBAL_BATCH,
                                                    precision="fp32"))
    if layout.startswith("interleaved-zero"):  # not in LAYOUTS (CI time): PP 2 x DP 2, 2 chunks per rank
        return make_plan([b.name for b in prof.blocks], model_fingerprint=prof.fingerprint, dp=2, pp=2,
                         zero_stage=int(layout[-1]), global_batch=GLOBAL_BATCH, num_microbatches=4,
                         schedule="interleaved_1f1b", virtual_stages=2)
    dp, tp, pp, zero = {"dp2xtp2": (2, 2, 1, 0), "pp2xdp2": (2, 1, 2, 0), "zero3": (4, 1, 1, 3),
                        "tp2xpp2": (1, 2, 2, 0)}[layout]
    rules = tuple(r for b in prof.blocks if tp_splits(b, tp) for r in b.tp_rules)
    return make_plan([b.name for b in prof.blocks], model_fingerprint=prof.fingerprint, dp=dp, tp=tp, pp=pp,
                     zero_stage=zero, global_batch=GLOBAL_BATCH, num_microbatches=(4 // dp) if pp > 1 else 1,
                     tensor_parallel=rules)  # pipeline micro-batches of 2 samples: one trace serves both


# -- the worker ---------------------------------------------------------------------------------------


def full_params(pm: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    mods = pm.module if isinstance(pm.module, list) else [pm.module]
    out: dict[str, torch.Tensor] = {}
    for m in mods:
        sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
        out.update({k: v.detach().clone() for k, v in sd.items()})
    return out


def run_case(arch: str, layout: str, prof: Any, data: list, ref: tuple) -> dict[str, Any]:
    import torch.distributed as dist

    import whalepy
    from whalepy.runtime import parallelize

    start = time.perf_counter()
    out: dict[str, Any] = {"arch": arch, "layout": layout}
    try:
        plan = layout_plan(layout, prof)
        plan.check_against(profile=prof)  # what Plan.load(model=) and `whalepy show --check` run
        out["embed_tp"] = next(st.tp_degree for st in plan.stages if "embed" in st.block_names)
        out["plan"] = f"pp{plan.pp_degree} dp{plan.dp_degree} tp{max(plan.tp_degrees)} " \
                      f"zero{int(plan.stages[0].zero_stage)}"
        pm = parallelize(build(arch), None, example_inputs=tuple(t[:2] for t in data[0][0]), loss_fn=loss_fn,
                         optimizer=sgd, global_batch=GLOBAL_BATCH, plan=plan, profile=prof)
        losses = [pm.train_step(x, y).item() for x, y in data]
        params = full_params(pm)
        ref_losses, ref_params, _ = ref
        # whole ranks hold every parameter; a pipeline rank holds its stage's (the test checks all of them
        # are covered across ranks)
        out["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        out["param_err"] = max((params[k] - ref_params[k]).abs().max().item() for k in params)
        out["params"] = sorted(params)
        out["losses"] = losses
    except whalepy.WhalepyError as e:
        out["refused"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the test as a failure with its traceback
        import traceback

        out["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    if os.environ.get("WHALEPY_ZOO_VERBOSE") and ("error" in out or "refused" in out):
        print(f"RANK {dist.get_rank()} {arch} {layout}:", out.get("error") or out.get("refused"), flush=True)
    # a rank that failed must not leave the others waiting in a collective of the next case
    failed = torch.tensor([1 if ("error" in out or "refused" in out) else 0])
    dist.all_reduce(failed)
    out["any_rank_failed"] = bool(failed.item())
    out["seconds"] = time.perf_counter() - start
    if os.environ.get("WHALEPY_ZOO_VERBOSE") and dist.get_rank() == 0:
        print("CASE", arch, layout, {k: v for k, v in out.items() if k not in ("params", "losses")},
              flush=True)
    return out


def profile_summary(prof: Any) -> dict[str, Any]:
    """What the pattern pass found, for the test to check: rules, modules left whole, block modules."""
    return {
        "rules": {r.module: {"style": r.style.value, "parts": r.parts, "feeds_rowwise": r.feeds_rowwise,
                             "copy_output": r.copy_output} for b in prof.blocks for r in b.tp_rules},
        "whole": {m: why for b in prof.blocks for m, why in b.tp_whole},
        "blocks": {b.name: list(b.modules) for b in prof.blocks},
        "report": prof.tp_report(),
    }


def _shared_profile(arch: str, data: list) -> Any:
    """The architecture's profile, captured on rank 0 only (capture is the costliest step of a case on
    2 cores) and sent to the others without its graph, which lowering does not need."""
    import dataclasses

    import torch.distributed as dist

    import whalepy

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = dataclasses.replace(whalepy.profile(build(arch), tuple(t[:2] for t in data[0][0])), graph=None)
        except whalepy.WhalepyError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def _shared_reference(arch: str, data: list) -> tuple:
    """The single-process reference, trained on rank 0 only and sent to the others (CI time: four ranks
    training the same reference on two cores cost four; every rank compares with the same values)."""
    import torch.distributed as dist

    box: list[Any] = [reference(arch, data) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _trace_each_split_once() -> None:
    """CI time: ``split_stages`` traces the whole model (``torch.export``) for every pipeline case, the
    costliest step of one (2.5 of 4 s for Llama under TP 2 x PP 2, every rank). The trace depends on the
    model's structure, the example inputs and the block paths, which are the same for an architecture's
    pipeline layouts here (one config per architecture), so each process traces a split once; the stages
    are still built from each case's own fresh model (parameters and buffers are looked up in it)."""
    from whalepy.runtime import _stage_split

    if getattr(_stage_split._export, "zoo_cached", False):
        return
    export, cache = _stage_split._export, {}

    def cached(model: Any, args: tuple, kwargs: dict, paths: tuple[str, ...]) -> Any:
        key = (type(model).__qualname__, repr(getattr(model, "config", None)),
               tuple((n, tuple(p.shape)) for n, p in model.named_parameters()),
               tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)), tuple(kwargs), paths)
        if key not in cache:
            cache[key] = export(model, args, kwargs, paths)
        return cache[key]

    cached.zoo_cached = True  # type: ignore[attr-defined]
    _stage_split._export = cached


def run_matrix(archs: tuple[str, ...] = ARCHS, layouts: tuple[str, ...] = LAYOUTS) -> list[dict[str, Any]]:
    """Per rank: every ``(arch, layout)`` case; a profile and a reference run per architecture."""
    import whalepy

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _trace_each_split_once()
    if os.environ.get("WHALEPY_ZOO_DUMP"):  # manual runs: where each rank is after that many seconds
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["WHALEPY_ZOO_DUMP"]), exit=True)
    results = []
    for arch, lays in [*((a, layouts) for a in archs), ("gpt_v50257", ("planner",))]:
        data = batches(arch)
        try:
            prof = _shared_profile(arch, data)
        except whalepy.WhalepyError as e:
            results += [{"arch": arch, "layout": lay, "refused": f"{type(e).__name__}: {e}",
                         "any_rank_failed": True} for lay in lays]
            continue
        ref = _shared_reference(arch, data)
        first = len(results)
        for layout in lays:
            results.append(run_case(arch, layout, prof, data, ref))
            results[-1]["reference_params"] = ref[2]
        if results[first:]:
            results[first]["profile"] = profile_summary(prof)
    return results


if __name__ == "__main__":  # python tests/zoo_cases.py [arch ...]: the matrix on 4 ranks, as a table
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from dist_harness import run_distributed

    os.environ["WHALEPY_ZOO_VERBOSE"] = "1"
    args = sys.argv[1:]
    known = (*LAYOUTS, "interleaved-zero0", "interleaved-zero2", "interleaved-zero3")
    layouts = tuple(a for a in args if a in known) or LAYOUTS
    archs = tuple(a for a in args if a not in known) or ARCHS
    t0 = time.perf_counter()
    per_rank = run_distributed(run_matrix, 4, archs, layouts, timeout=1800)
    for i, r in enumerate(per_rank[0]):
        errs = [pr[i].get("error") for pr in per_rank if pr[i].get("error")]
        status = (f"loss {r['loss_err']:.1e} param {max(pr[i].get('param_err', 0) for pr in per_rank):.1e}"
                  if "loss_err" in r and not errs else
                  (r.get("refused") or (errs[0] if errs else "another rank failed")))
        print(f"{r['arch']:12} {r['layout']:8} {r.get('plan', ''):22} {r.get('seconds', 0):5.1f}s  {status[:400]}")
    print(f"total {time.perf_counter() - t0:.1f} s")
