"""Per-rank worker and single-process references for the meta-device tests (no tests here).

One 8-process launch runs six phases in a row (process start-up is the slow part):

A. GPT on meta, DP x TP x PP = 2 x 2 x 2, ZeRO-3, initialised by whalepy: 3 steps.
B. the same meta GPT under DP x TP = 4 x 2 (ZeRO-2): 2 steps, saved (DCP).
C. GPT on meta, 2 x 2 x 2, weights from B's checkpoint: 2 more steps.
D. HF Llama on meta, 2 x 2 x 2, weights from its ``save_pretrained`` safetensors: 2 steps, saved, and
   gathered whole on rank 0 (pipeline path of ``full_state_dict``).
E. HF Llama on meta, DP x TP = 4 x 2, weights from D's checkpoint: logits of a fixed batch, and the
   full state dict (``get_model_state_dict``'s own full-state-dict path).
F. GPT on meta under plain DDP (ZeRO-0, dp 8): 1 step.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from runtime_cases import SEQ, VOCAB, batches, lm_loss, profile_tp_rules

GLOBAL_BATCH = 8
STEPS = 4  # A uses steps 0-2, B steps 0-1, C steps 2-3


def gpt_config() -> Any:
    from whalepy.models import GPTConfig

    # no biases: a key projection's bias has an exactly-zero gradient (softmax ignores it), so AdamW
    # turns rounding noise into full-size steps there and no two summation orders agree on it
    return GPTConfig(vocab_size=VOCAB, block_size=SEQ, num_layers=4, num_heads=4, hidden_size=64, bias=False)


def llama_config() -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      use_cache=False, tie_word_embeddings=False, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def meta_gpt() -> torch.nn.Module:
    from whalepy.models import GPT

    with torch.device("meta"):
        return GPT(gpt_config())


def meta_llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(llama_config())


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _autocast(precision: str) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


def train(model: torch.nn.Module, data: list, precision: str, states: list | None = None) -> list[float]:
    """Single-process reference: the same loss, optimizer and batches as the parallel runs; appends
    the weights after each step to ``states`` when given."""
    opt = adamw(model.parameters())
    losses = []
    for x, y in data:
        with _autocast(precision):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if states is not None:
            states.append({k: v.clone() for k, v in model.state_dict().items()})
    return losses


def references(llama_dir: str, precision: str) -> dict[str, Any]:
    """Run in the test process: the single-process losses every phase is compared with, and the HF
    Llama checkpoint phase D starts from."""
    import whalepy
    from transformers import LlamaForCausalLM

    data = batches(GLOBAL_BATCH, STEPS)
    gpt = meta_gpt()
    whalepy.materialize(gpt, seed=0)  # what parallelize(seed=0) gives each rank's shards
    gpt_init = {k: v.clone() for k, v in gpt.state_dict().items()}
    states: list[dict[str, torch.Tensor]] = []
    a_losses = train(gpt, data[:3], precision, states)
    resumed = meta_gpt()
    resumed.to_empty(device="cpu")
    resumed.load_state_dict(states[1])
    c_losses = train(resumed, data[2:4], precision)  # C: weights from the checkpoint, fresh AdamW

    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config())
    llama.save_pretrained(llama_dir, max_shard_size="40KB")  # several shards and an index
    llama_init = {k: v.clone() for k, v in llama.state_dict().items()}
    llama_fp32 = LlamaForCausalLM.from_pretrained(llama_dir)  # the same start, trained in fp32
    d_losses = train(llama, data[:2], precision)
    train(llama_fp32, data[:2], "fp32")
    return {"A": a_losses, "B": a_losses[:2], "C": c_losses, "D": d_losses, "gpt_init": gpt_init,
            "llama_init": llama_init, "llama_state": {k: v.clone() for k, v in llama.state_dict().items()},
            "llama_state_fp32": {k: v.clone() for k, v in llama_fp32.state_dict().items()}}


def build_profiles() -> dict[str, Any]:
    """The front end's profiles of both models (blocks, TP rules, fingerprints), made once in the test
    process and shipped to the ranks (capture is the slow part of a launch)."""
    import whalepy

    x = torch.zeros(2, SEQ, dtype=torch.long)
    # without the captured graph, which does not survive pickling into a fresh interpreter
    return {"gpt": dataclasses.replace(whalepy.profile(meta_gpt(), (x,)), graph=None),
            "llama": dataclasses.replace(whalepy.profile(meta_llama(), (x,)), graph=None)}


def _plan(model: torch.nn.Module, prof: Any, *, dp: int, tp: int, pp: int, zero: int, precision: str) -> Any:
    from whalepy.runtime import make_plan

    return make_plan([b.name for b in prof.blocks], model_fingerprint=prof.fingerprint, dp=dp, tp=tp,
                     pp=pp, global_batch=GLOBAL_BATCH, zero_stage=zero, precision=precision,
                     num_microbatches=2 if pp > 1 else 1, tensor_parallel=profile_tp_rules(prof))


def _memory(model: torch.nn.Module, pm: Any) -> dict[str, Any]:
    """What materialisation held, and whether every parameter of the model outside this rank's
    modules (other pipeline stages) is still on the meta device."""
    mods = pm.module if isinstance(pm.module, list) else [pm.module]
    local = {id(p) for m in mods for p in m.parameters()}
    others = [p for p in model.parameters() if id(p) not in local]
    return {"stats": pm.init_stats, "others_meta": all(p.is_meta for p in others),
            "num_others": len(others)}


def sizes(model: torch.nn.Module, block: str) -> tuple[int, int]:
    """Bytes of the whole model and of one block, in fp32, from the meta model's shapes."""
    full = sum(p.numel() * 4 for p in model.parameters())
    return full, sum(p.numel() * 4 for p in model.get_submodule(block).parameters())


def _arrays(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Tensors as numpy arrays: they travel back by value (torch shares tensors through file
    descriptors that die with the worker)."""
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def run_meta_cases(root: str, llama_dir: str, profiles: dict[str, Any], precision: str) -> dict[str, Any]:
    import torch.distributed as dist

    from whalepy.runtime import parallelize

    warnings.filterwarnings("ignore")
    data = batches(GLOBAL_BATCH, STEPS)
    x0 = data[0][0][:2]
    out: dict[str, Any] = {}
    opts = dict(loss_fn=lm_loss, optimizer=adamw, global_batch=GLOBAL_BATCH)

    def launch(model: torch.nn.Module, prof: Any, layout: dict[str, int], plan_precision: str = precision,
               **kw: Any) -> Any:
        return parallelize(model, None, example_inputs=(x0,),
                           plan=_plan(model, prof, **layout, precision=plan_precision), profile=prof, **opts, **kw)

    gpt_prof, llama_prof = profiles["gpt"], profiles["llama"]
    model = meta_gpt()
    pm = launch(model, gpt_prof, dict(dp=2, tp=2, pp=2, zero=3), seed=0)
    initial = _arrays(pm.full_state_dict())
    out["A"] = {"losses": [pm.train_step(x, y).item() for x, y in data[:3]],
                **_memory(model, pm), "full": initial}

    pm = launch(meta_gpt(), gpt_prof, dict(dp=4, tp=2, pp=1, zero=2), seed=0)
    out["B"] = {"losses": [pm.train_step(x, y).item() for x, y in data[:2]]}
    pm.save(f"{root}/gpt_b")
    dist.barrier()

    model = meta_gpt()
    pm = launch(model, gpt_prof, dict(dp=2, tp=2, pp=2, zero=3), checkpoint=f"{root}/gpt_b")
    out["C"] = {"losses": [pm.train_step(x, y).item() for x, y in data[2:4]],
                **_memory(model, pm)}

    model = meta_llama()
    pm = launch(model, llama_prof, dict(dp=2, tp=2, pp=2, zero=3), checkpoint=llama_dir)
    out["D"] = {"losses": [pm.train_step(x, y).item() for x, y in data[:2]],
                **_memory(model, pm)}
    pm.save(f"{root}/llama_d")
    out["D"]["full"] = _arrays(pm.full_state_dict())
    dist.barrier()

    # export is checked in fp32 (its logits against from_pretrained's, 1e-5): this plan is fp32
    pm = launch(meta_llama(), llama_prof, dict(dp=4, tp=2, pp=1, zero=3), plan_precision="fp32",
                checkpoint=f"{root}/llama_d")
    with torch.no_grad():
        logits = pm.module(data[0][0][:4]).logits
    out["E"] = {"logits": logits.detach().numpy().copy(), "full": _arrays(pm.full_state_dict())}

    # F: the meta GPT under plain DDP (ZeRO-0, dp 8): DDP reads its parameters when built, so it is
    # wrapped after materialisation (issue 25); A's first step
    pm = launch(meta_gpt(), gpt_prof, dict(dp=8, tp=1, pp=1, zero=0), seed=0)
    out["F"] = {"losses": [pm.train_step(*data[0]).item()]}
    return out
