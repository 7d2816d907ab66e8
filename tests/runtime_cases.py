"""Shared model builders and the per-rank worker for the runtime multi-process tests (no tests here).

The worker trains a single-process reference and the parallelized copy from the same weights on the
same batches, and reports per-step loss differences and the largest parameter difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from whalepy.models import GPT, GPTConfig
from whalepy.ir.plan import TPRule

SEQ = 16
VOCAB = 64
PAD = 30


ODD_VOCAB = 63
"""A vocabulary no TP degree above 1 divides: the embedding and head run whole on every TP rank."""


def gpt_model(num_layers: int = 2, *, vocab: int = VOCAB, tied: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, block_size=SEQ, num_layers=num_layers, num_heads=4,
                         hidden_size=32, tie_embeddings=tied))


def vocab_of(kind: str) -> int:
    return ODD_VOCAB if kind == "gpt_odd" else VOCAB


def hf_gpt2_model(num_layers: int = 2, tied: bool = False) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=num_layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     tie_word_embeddings=tied)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


def llama_model(num_layers: int = 2) -> torch.nn.Module:
    """Tiny HF Llama: GQA (4 query heads, 2 key/value heads), untied, no cache, no dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False,
                      attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


_PROFILES: dict[tuple[str, int], Any] = {}


def case_profile(kind: str, num_layers: int = 2) -> Any:
    """The front end's profile of the case's model (cached per process): its blocks, module paths,
    fingerprint and the tensor-parallel rules its FX pattern pass found."""
    import whalepy

    key = (kind, num_layers)
    if key not in _PROFILES:
        x = torch.zeros(2, SEQ, dtype=torch.long)
        _PROFILES[key] = whalepy.profile(build_model(kind, num_layers), (x,))
    return _PROFILES[key]


def profile_tp_rules(profile: Any) -> tuple[TPRule, ...]:
    """Every block's tensor-parallel rules, as the planner would put them in a plan."""
    return tuple(r for b in profile.blocks for r in b.tp_rules)


def lm_loss(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):  # HF output object
        logits = logits.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(global_batch: int, steps: int, seed: int = 1, vocab: int = VOCAB) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (global_batch, SEQ), generator=g)
        y = torch.randint(0, vocab, (global_batch, SEQ), generator=g)
        out.append((x, y))
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def adamw_foreach(params):
    """AdamW's multi-tensor step, torch's default on CUDA (the loop is the default on CPU)."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)


def build_model(kind: str, num_layers: int = 2) -> torch.nn.Module:
    """``kind``: "gpt" (whalepy.models), "gpt_tied" (it with a tied embedding and head), "gpt_odd" (it
    with a vocabulary of :data:`ODD_VOCAB`), "gpt_pad" (it with a ``padding_idx``), "hf" (HF GPT-2, untied),
    "hf_tied" (HF GPT-2 with its default tie_word_embeddings=True), "llama" (HF Llama, GQA)."""
    if kind == "gpt":
        return gpt_model(num_layers)
    if kind == "gpt_tied":  # embedding and head one weight
        return gpt_model(num_layers, tied=True)
    if kind == "gpt_odd":  # a vocabulary TP does not divide: embedding and head run whole
        return gpt_model(num_layers, vocab=ODD_VOCAB)
    if kind == "gpt_pad":  # the GPT with a padding token: its row gets no gradient
        model = gpt_model(num_layers)
        model.transformer.wte.padding_idx = PAD
        return model
    if kind == "llama":
        return llama_model(num_layers)
    return hf_gpt2_model(num_layers, tied=kind == "hf_tied")


def reference_run(kind: str, data, num_layers: int = 2):
    return train_single(build_model(kind, num_layers), data)


def train_single(model: torch.nn.Module, data):
    """Train ``model`` in this process with :func:`adamw` on ``data``; its losses and final state."""
    opt = adamw(model.parameters())
    losses = []
    for x, y in data:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_params(pm) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    mods = pm.module if isinstance(pm.module, list) else [pm.module]
    out = {}
    for m in mods:
        sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
        out.update({k: v.detach().clone() for k, v in sd.items()})
    return out


@dataclass
class Case:
    name: str
    kind: str = "gpt"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    checkpoint: bool = False
    shares: tuple[int, ...] | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    global_batch: int = 8
    steps: int = 3
    num_layers: int = 2
    virtual_stages: int = 1
    foreach: bool = False  # the optimizer's multi-tensor step (CUDA's default): adamw_foreach
    extra: dict = field(default_factory=dict)


def make_case_plan(case: Case):
    from whalepy.runtime import make_plan

    # the real front-end path: profile blocks and FX-pattern TP rules -> plan -> DTensor
    from whalepy.ir.rules import tp_splits

    prof = case_profile(case.kind, case.num_layers)
    blocks = [b.name for b in prof.blocks]
    # the planner's rule: blocks whose shapes do not divide by the TP degree run whole, without rules
    rules = tuple(r for b in prof.blocks if tp_splits(b, case.tp) for r in b.tp_rules) if case.tp > 1 \
        else profile_tp_rules(prof)
    return make_plan(blocks, model_fingerprint=prof.fingerprint, dp=case.dp, tp=case.tp, pp=case.pp, global_batch=case.global_batch,
                     zero_stage=case.zero, checkpoint=case.checkpoint, batch_shares=case.shares,
                     num_microbatches=case.microbatches, schedule=case.schedule,
                     virtual_stages=case.virtual_stages, tensor_parallel=rules, **case.extra)


def run_case(case: Case) -> dict[str, Any]:
    """Per rank: train reference and parallel model; return loss/param differences."""
    from whalepy.runtime import parallelize

    data = batches(case.global_batch, case.steps, vocab=vocab_of(case.kind))
    ref_losses, ref_params = reference_run(case.kind, data, case.num_layers)
    model = build_model(case.kind, case.num_layers)
    plan = make_case_plan(case)
    pm = parallelize(
        model, None, example_inputs=(data[0][0][:2],), loss_fn=lm_loss,
        optimizer=adamw_foreach if case.foreach else adamw,
        global_batch=case.global_batch, plan=plan, profile=case_profile(case.kind, case.num_layers))
    losses = [pm.train_step(x, y).item() for x, y in data]
    params = full_params(pm)
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    param_err = max((params[k] - ref_params[k]).abs().max().item() for k in params)
    return {"name": case.name, "losses": losses, "ref": ref_losses, "loss_err": loss_err,
            "param_err": param_err, "num_params": len(params)}


def run_cases(cases: list[Any]) -> list[dict[str, Any]]:
    """Run each item: a :class:`Case`, or ``("resume", first, second, path)``."""
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", message=".*sequential all_gather.*")
    out = []
    for c in cases:
        out.append(run_resume(*c[1:]) if isinstance(c, tuple) else run_case(c))
    return out


def run_resume(first: Case, second: Case, path: str, split: int = 2) -> dict[str, Any]:
    """Train ``split`` steps under ``first``'s plan, save, resume under ``second``'s plan from a
    differently initialised model, train the rest; compare with the single-process run."""
    import torch.distributed as dist

    from whalepy.runtime import parallelize

    data = batches(first.global_batch, first.steps)
    ref_losses, ref_params = reference_run(first.kind, data, first.num_layers)
    mid_losses, mid_params = reference_run(first.kind, data[:split], first.num_layers)
    pm = parallelize(
        build_model(first.kind, first.num_layers), None, example_inputs=(data[0][0][:2],),
        loss_fn=lm_loss, optimizer=adamw_foreach if first.foreach else adamw, global_batch=first.global_batch,
        plan=make_case_plan(first),
        profile=case_profile(first.kind, first.num_layers))
    losses = [pm.train_step(x, y).item() for x, y in data[:split]]
    pm.save(path)
    dist.barrier()
    torch.manual_seed(123)  # a different initialisation: everything must come from the checkpoint
    other = build_model(second.kind, second.num_layers)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    pm2 = parallelize(
        other, None, example_inputs=(data[0][0][:2],), loss_fn=lm_loss,
        optimizer=adamw_foreach if second.foreach else adamw, global_batch=second.global_batch,
        plan=make_case_plan(second),
        profile=case_profile(second.kind, second.num_layers))
    pm2.load(path)
    loaded = full_params(pm2)
    load_errs = {k: (loaded[k] - mid_params[k]).abs().max().item() for k in loaded}
    load_err = max(load_errs.values())
    bad = sorted(k for k, v in load_errs.items() if v > 1e-5)
    losses += [pm2.train_step(x, y).item() for x, y in data[split:]]
    params = full_params(pm2)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_err = max((params[k] - ref_params[k]).abs().max().item() for k in params)
    return {"name": f"{first.name}->{second.name}", "load_err": load_err, "bad": bad, "loss_err": loss_err,
            "param_err": param_err, "num_params": len(params)}
