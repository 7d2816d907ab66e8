"""Per-rank workers for the checkpoint-offload tests (no tests here): plans whose checkpointed blocks keep
their inputs in host memory, trained against the single-process run, with what each block keeps between
its forward and its backward measured.

How the device bytes are measured (:class:`InputProbe`): at every block module's own forward (a forward
pre-hook registered last, so it sees the arguments the checkpoint saved, after FSDP2's and TP's hooks)
the probe takes a weak reference to the storage of each positional tensor argument (a DTensor's local shard). When the checkpoint
recomputes that forward in backward (the module runs again with the checkpoint's hooks off), the probe
looks at the weak references of the oldest forward not yet recomputed (pipeline schedules run backwards
in the order of their forwards): a storage still alive is device memory the block kept between forward
and backward (PyTorch preserves a storage's Python object while any tensor, saved variable or view still
uses it, so a weak reference dies exactly when the memory is freed). With the input on the device
(``checkpoint`` alone) the kept bytes are the input's bytes; with ``checkpoint_offload`` they are 0 and
the host copy the runtime records (``ParallelModel.checkpoint_host_bytes``) is the input's size.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from typing import Any

import torch
from torch import nn

from runtime_cases import (
    Case, adamw, batches, build_model, case_profile, lm_loss, make_case_plan, reference_run)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what the runtime copies); a tensor itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


class InputProbe:
    """Device bytes each watched module keeps of its input between forward and backward (module
    docstring): ``kept[name]`` the largest over its forwards, ``input_bytes[name]`` its input's bytes."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        from torch.distributed._composable import checkpoint

        self.kept: dict[str, int] = {}
        self.input_bytes: dict[str, int] = {}
        self.recomputed: dict[str, int] = {}
        for name, m in modules.items():
            pending: deque[list[tuple[weakref.ref, int]]] = deque()

            def hook(mod: nn.Module, args: tuple, name: str = name, pending: deque = pending) -> None:
                tensors = [_local(a) for a in args if isinstance(a, torch.Tensor)]
                if checkpoint.state(mod).enable_hook:  # the forward itself
                    if torch.is_grad_enabled():
                        pending.append([(weakref.ref(t.untyped_storage()), t.untyped_storage().nbytes())
                                        for t in tensors])
                        self.input_bytes[name] = sum(t.numel() * t.element_size() for t in tensors)
                    return
                refs = pending.popleft()  # the recompute in backward
                kept = sum(n for ref, n in refs if ref() is not None)
                self.kept[name] = max(self.kept.get(name, 0), kept)
                self.recomputed[name] = self.recomputed.get(name, 0) + 1

            m.register_forward_pre_hook(hook)


def _local_blocks(pm: Any, profile: Any) -> dict[str, tuple[nn.Module, bool]]:
    """This rank's block modules by path, each with whether it is the first module of its stage module,
    whose input its caller keeps alive: the batch (the model's first block) or the stage input (the
    pipeline schedule keeps it for the stage's input gradient)."""
    out: dict[str, tuple[nn.Module, bool]] = {}
    for mod in pm._modules:
        first = True
        for b in profile.blocks:
            for path in b.modules:
                try:
                    sub = mod.get_submodule(path)
                except AttributeError:
                    continue
                out[path] = (sub, first)
                first = False
    return out


def with_blocks(plan: Any, **fields: Any) -> Any:
    """``plan`` with ``fields`` on every block."""
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, blocks=tuple(dataclasses.replace(b, **fields) for b in s.blocks))
        for s in plan.stages))


def _plan(case: Case, fields: dict[str, Any], tiles: int, sequence_parallel: bool) -> tuple[Any, Any]:
    """``case``'s plan with ``fields`` on every block, ``tiles`` on every block with linears or
    embeddings, and with sequence parallelism (the pattern pass's SEQUENCE rules); and the profile it
    was made from."""
    import whalepy
    from runtime_cases import SEQ, profile_tp_rules
    from tiling_cases import tiled_plan

    if not sequence_parallel:
        return tiled_plan(case, tiles, **fields), case_profile(case.kind, case.num_layers)
    prof = whalepy.profile(build_model(case.kind, case.num_layers), (torch.zeros(2, SEQ, dtype=torch.long),),
                           sequence_parallel=True)
    plan = dataclasses.replace(make_case_plan(case), tensor_parallel=profile_tp_rules(prof))
    return with_blocks(plan, **fields), prof


def run_checkpoint_offload(cases: list[tuple[Case, dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per case (a :class:`Case`, fields for every block, and ``tiles`` / ``sequence_parallel``): 3 steps
    against the single-process run, and per block module the device bytes kept of its input, its input
    bytes and the host bytes."""
    from whalepy.runtime import parallelize

    refs: dict[tuple, Any] = {}
    out = []
    for case, fields, options in cases:
        data = batches(case.global_batch, case.steps)
        key = (case.kind, case.num_layers)
        if key not in refs:
            refs[key] = reference_run(case.kind, data, case.num_layers)
        ref_losses, ref_params = refs[key]
        plan, prof = _plan(case, fields, options.get("tiles", 1), options.get("sequence_parallel", False))
        pm = parallelize(build_model(case.kind, case.num_layers), None, example_inputs=(data[0][0][:2],),
                         loss_fn=lm_loss, optimizer=adamw, global_batch=case.global_batch, plan=plan, profile=prof)
        blocks = _local_blocks(pm, prof)
        probe = InputProbe({p: m for p, (m, _) in blocks.items()})
        losses = [pm.train_step(x, y).item() for x, y in data]
        params = pm.full_state_dict()  # original names (tiles merged), on rank 0 only
        out.append({
            "name": case.name, "fields": fields, "options": options,
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": max((params[k] - ref_params[k]).abs().max().item() for k in ref_params) if params else None,
            "blocks": {p: {"kept": probe.kept.get(p), "input": probe.input_bytes.get(p),
                           "recomputed": probe.recomputed.get(p, 0), "stage_input": first,
                           "host": pm.checkpoint_host_bytes.get(m)}
                       for p, (m, first) in blocks.items()}})
    return out
