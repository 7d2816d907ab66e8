"""The typed values the lowering steps pass one another (:mod:`whalepy.runtime.lower`).

:class:`LowerContext` is what :func:`~whalepy.runtime.parallel_model.parallelize` learned once from its
arguments and the launch; :class:`StagePart` is one (virtual) pipeline stage this rank holds, as the
steps rewrite it; :class:`Lowered` is what :class:`~whalepy.runtime.parallel_model.ParallelModel` runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from whalepy.ir.plan import BlockPlan
from whalepy.ir.rules import LoweringKind
from whalepy.runtime._pm_helpers import LossFn

if TYPE_CHECKING:
    from whalepy.runtime._amp import AmpContext
    from whalepy.runtime._joint_step import JointStep
    from whalepy.runtime.host_optimizer import HostOptimizer
    from whalepy.runtime.materialize import InitFn, MaterializeStats
    from whalepy.runtime.mesh import RankMeshes
    from whalepy.runtime.nvme import NvmeTier
    from whalepy.runtime.pseudo_record import PseudoBuild

__all__ = ["BatchContract", "Blocks", "LowerContext", "Lowered", "Optimizers", "StagePart", "Tied"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass(frozen=True, kw_only=True)
class LowerContext:
    """What ``parallelize`` learned once: its checked arguments and this rank's device type."""

    device_type: str
    """``"cuda"`` or ``"cpu"``: this rank's device type (``mesh.resolve_device_type``)."""
    cluster_spec: Any
    example_inputs: tuple
    """The example inputs as a tuple of positional model inputs."""
    loss_fn: LossFn
    """The user's loss, wrapped so that a non-scalar result fails with one line (``_checked_loss``)."""
    optimizer_factory: OptimizerFactory
    profile: Any = None
    """The model's ``ModelProfile`` when known: block -> module paths."""
    loss_parallel: bool = False
    sync_initial_weights: bool = True
    nvme_dir: str | os.PathLike[str] | None = None
    nvme_keep: bool = False
    init_fn: InitFn | None = None
    seed: int = 0
    checkpoint: str | os.PathLike[str] | None = None
    max_grad_norm: float | None = None
    log_every: int | None = None
    lr_scheduler: SchedulerFactory | None = None
    total_steps: int | None = None
    metrics: Sequence[Any] = ()


@dataclass(frozen=True)
class Blocks:
    """The plan's blocks in this model: block name -> module paths, and block -> {module path: tiles}
    for memory-centric tiling (both checked against the model before anything is built)."""

    modules: dict[str, tuple[str, ...]]
    tiling: dict[str, dict[str, int]]


@dataclass(frozen=True)
class BatchContract:
    """What a batch must look like, read from the unsharded model before lowering: per-sample shapes of
    the example inputs, their number, the model's positions (``max_positions``) and token vocabulary."""

    example_shapes: list[tuple[int, ...]]
    num_inputs: int
    max_positions: Any
    vocab: Any


@dataclass(frozen=True)
class StagePart:
    """One pipeline stage this rank holds (the whole model without pipeline stages)."""

    index: int
    """Its pipeline stage index (physical stage ``s`` holds ``s, s + pp, ...``)."""
    module: nn.Module
    """The stage's module: the model, a split stage, and after ``apply_data_parallel`` its wrapped root."""
    chunk: list[BlockPlan]
    """The plan's blocks of this stage, in model order."""
    blocks: list[tuple[BlockPlan, list[nn.Module]]] = field(default_factory=list)
    """Each block with its modules in ``module`` (resolved after tiling)."""


@dataclass(frozen=True)
class Tied:
    """A parameter shared by several pipeline stages: this rank's copies (after TP / FSDP2 and
    materialising), the group of pipeline ranks holding one, and ``(stage, name)`` of every holder."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    holders: list[tuple[int, str]]


@dataclass(frozen=True)
class Optimizers:
    """What steps this rank's parameters: the device optimizer (None when the host optimizer holds them
    all), the host optimizer (ZeRO-Offload), the disk tier, mixed precision, and the joint step."""

    optimizer: torch.optim.Optimizer | None
    host: HostOptimizer | None
    nvme: NvmeTier | None
    amp: AmpContext
    joint: JointStep | None


@dataclass(frozen=True)
class Lowered:
    """This rank's lowered model: what :class:`~whalepy.runtime.parallel_model.ParallelModel` trains."""

    meshes: RankMeshes
    kind: LoweringKind
    parts: list[StagePart]
    tied: list[Tied]
    optim: Optimizers
    schedule: Any
    """The pipeline schedule (``torch.distributed.pipelining``), None without pipeline stages."""
    stats: MaterializeStats | None
    """What materialising a meta-device model allocated, None for a model that held its weights."""
    blocks: Blocks
    batch: BatchContract
    pseudo: PseudoBuild | None
    config: tuple[Any, type]
    """The model's HF ``config`` (or None) and class: what ``save`` writes as ``config.json``."""
    checkpoint_host_bytes: dict[nn.Module, int]
    """Per module of a block with ``checkpoint_offload``: host bytes its last forward kept."""
    compiled: Any = None
    """What :func:`~whalepy.runtime.compile_blocks.compile_blocks` did on this rank
    (:class:`~whalepy.runtime.compile_blocks.CompileStats`), None when the plan does not compile."""
