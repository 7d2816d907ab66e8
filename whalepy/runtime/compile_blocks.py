"""Compiled blocks (``Plan.compile``): each block's modules run under ``torch.compile``, one compiled
region per module (regional compilation), the rest of the step eager.

Why regions and not the whole model: a transformer repeats one block class, and torch compiles the
block's ``forward`` once and reuses the code for every instance whose guards hold (parameters are graph
inputs, not constants: ``torch._dynamo.config.inline_inbuilt_nn_modules``), so the compile time is that
of one block, not of the model; and the parallel machinery around the blocks stays eager, as torchtitan
arranges it (tensor parallelism and activation checkpointing applied first, the block compiled, FSDP2
wrapped around it).

What whalepy compiles is the module's ``forward`` alone (:class:`_CompiledForward` replaces the instance's
``forward``): the module's hooks, which FSDP2 (``fully_shard``: all-gather before, reshard after), the
composable activation checkpoint and the activation-offload hooks use, run eagerly around it, and the
module keeps its name and its ``state_dict`` keys (``torch.compile(module)`` would wrap it in an
``OptimizedModule`` whose keys carry an ``_orig_mod.`` prefix, breaking checkpoints across plans). The
order in the lowering is TP -> tiling -> checkpointing / offload hooks -> compile -> FSDP2 / DDP; DTensor
parameters and activations under TP are traced by dynamo as DTensors; pipeline stages call the compiled
blocks from their stage ``GraphModule``.

Modules that hold an ``nn.Embedding`` stay eager: a lookup is one gather, with nothing around it to
fuse, and the vocabulary-parallel embedding of tensor parallelism (DTensor's ``MaskPartial``) does not
trace in torch 2.13 (AOTAutograd fails with "Mixing fake modes", having left a fake tensor in the
DTensor's mask buffer, so the eager fallback below cannot run it either).

``torch.compile`` compiles on the first call. A block whose compile fails there (dynamo or the backend
raises: an unsupported construct, a C++ / Triton compile error) runs eagerly from then on, said in one
warning naming the block and the reason; other errors (a user's bug) are raised as they are. A failure
while compiling the *backward* graph, which AOTAutograd does at the first backward, cannot be undone
mid-step and is raised. The first calls' compile time is recorded (:class:`CompileStats`); the step
report counts the first step apart (``_report.StepReporter``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from whalepy.log import warn_once

__all__ = ["BACKEND", "CompileStats", "compile_blocks", "is_compile_error"]

log = logging.getLogger("whalepy.runtime")

BACKEND: Any = "inductor"
"""The ``torch.compile`` backend of compiled blocks: inductor (Triton kernels on CUDA, C++ / OpenMP on
CPU). The multi-process CI tests set ``"aot_eager"`` (dynamo and AOTAutograd without code generation):
inductor's C++ build takes 25-75 s per graph on the 2-core CI machine."""


@dataclass
class CompileStats:
    """What :func:`compile_blocks` did on this rank."""

    modules: int = 0
    """Modules whose ``forward`` runs compiled (or was to: see :attr:`fell_back`)."""
    fell_back: list[tuple[str, str]] = field(default_factory=list)
    """``(block, reason)`` of the blocks that run eagerly because their compile failed."""
    eager: list[nn.Module] = field(default_factory=list)
    """Modules of the blocks left eager: those holding an embedding."""
    first_call_s: float = 0.0
    """Wall seconds of the compiled modules' first forward calls (dynamo, AOTAutograd and the backend's
    forward compile, and one run)."""


def is_compile_error(e: BaseException) -> bool:
    """Whether ``e`` comes from ``torch.compile`` (dynamo, AOTAutograd, inductor), not from the model."""
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(e, TorchDynamoException):
        return True
    mod = type(e).__module__ or ""
    return mod.startswith(("torch._dynamo", "torch._inductor", "torch._functorch"))


class _CompiledForward:
    """A module's ``forward`` compiled, falling back to the eager one if its compile fails."""

    def __init__(self, module: nn.Module, block: str, backend: Any, stats: CompileStats) -> None:
        self.eager = module.forward  # the bound method, before this object replaces it
        self.compiled: Any = torch.compile(self.eager, backend=backend)
        self.block = block
        self.stats = stats
        self.first = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - only compile errors are handled, the rest re-raised
            if not is_compile_error(e):
                raise
            self.compiled = None
            reason = " ".join(str(e).split())[:200] or type(e).__name__
            self.stats.fell_back.append((self.block, reason))
            warn_once(f"compile-fallback-{self.block}", "whalepy: block %r runs eagerly: torch.compile failed "
                      "(%s: %s)", self.block, type(e).__name__, reason, log=log)
            return self.eager(*args, **kwargs)
        if self.first:
            self.first = False
            self.stats.first_call_s += time.perf_counter() - t0
        return out


def compile_blocks(blocks: Sequence[tuple[Any, Sequence[nn.Module]]], *, backend: Any = None,
                   stats: CompileStats | None = None) -> CompileStats:
    """Compile the ``forward`` of every module of ``blocks`` (pairs of a block, or its name, and its
    modules) in place; return ``stats`` (a new :class:`CompileStats` if None) updated."""
    stats = stats if stats is not None else CompileStats()
    backend = BACKEND if backend is None else backend
    for block, modules in blocks:
        name = block if isinstance(block, str) else block.name
        for m in modules:
            if isinstance(m.__dict__.get("forward"), _CompiledForward):
                continue  # a module shared by two blocks: compiled once
            if any(isinstance(x, nn.Embedding) for x in m.modules()):
                stats.eager.append(m)  # see the module docstring: embeddings stay eager
                continue
            m.forward = _CompiledForward(m, name, backend, stats)  # type: ignore[method-assign]
            stats.modules += 1
    return stats
