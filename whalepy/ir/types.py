"""Every enum shared between whalepy's steps, and the unit constant ``GIB``: the bottom of the data model.

Imports only :mod:`whalepy.errors`, so the plan, the cost models, the rules of what the runtime lowers and
the planner can all name these without importing one another.
"""

from __future__ import annotations

import enum

from whalepy.errors import PlanError, enum_member

GIB = 2**30
"""Bytes in a GiB: device and host memory sizes are read as GiB (cost_models/devices.py)."""

FLOAT_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the floating dtypes a profile is captured in, by torch's names (IEEE 754 binary64,
binary32, binary16, and bfloat16's 16 bits), so that planning from a stored profile needs no torch."""


def dtype_bytes(name: str) -> int:
    """Bytes per element of the floating dtype ``name`` (``"bfloat16"``, as :attr:`ModelProfile.dtype`
    holds it); torch's ``finfo`` for a name :data:`FLOAT_DTYPE_BYTES` does not list."""
    if name in FLOAT_DTYPE_BYTES:
        return FLOAT_DTYPE_BYTES[name]
    import torch

    return torch.finfo(getattr(torch, name)).bits // 8


class Precision(str, enum.Enum):
    """Number format of the math; selects which peak of the device row applies."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"

    @classmethod
    def _missing_(cls, value: object) -> Precision:
        return enum_member(cls, value, "precision")  # type: ignore[return-value]


class OptimizerImpl(str, enum.Enum):
    """Which implementation of the user's optimizer algorithm the runtime steps the device parameters
    with: torch's single-kernel ``fused=True`` variant of the same class and hyper-parameters where torch
    has one for the device and dtype, or the optimizer exactly as the user's factory built it."""

    FUSED = "fused"
    AS_GIVEN = "as_given"

    @classmethod
    def _missing_(cls, value: object) -> OptimizerImpl:
        return enum_member(cls, value, "optimizer implementation")  # type: ignore[return-value]


class Schedule(str, enum.Enum):
    """Pipeline schedule; values match the names used in ``torch.distributed.pipelining``."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"

    @classmethod
    def _missing_(cls, value: object) -> Schedule:
        return enum_member(cls, value, "pipeline schedule")  # type: ignore[return-value]


class Tier(str, enum.Enum):
    """Where a block's model states live between uses (ZeRO-Infinity's tiers)."""

    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"

    @classmethod
    def _missing_(cls, value: object) -> Tier:
        hint = ("a disk tier is 'nvme' (files on the node's drive, nvme_dir); " if isinstance(value, str) and
                value.strip().lower() in ("disk", "ssd", "file", "files", "nvm") else "")
        hint = "the host tier is 'cpu'; " if str(value).strip().lower() in ("host", "ram", "dram") else hint
        return enum_member(cls, value, "memory tier", hint)  # type: ignore[return-value]


class ZeroStage(enum.IntEnum):
    """ZeRO stage (Rajbhandari et al., SC'20): 0 plain DP, 1 optimizer states, 2 + gradients, 3 + params."""

    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3

    @classmethod
    def _missing_(cls, value: object) -> ZeroStage:
        raise PlanError(f"unknown ZeRO stage {value!r}: give an integer 0, 1, 2 or 3 (e.g. zero_stage=3)")


class TPStyle(str, enum.Enum):
    """How one module's weights are split across a tensor-parallel group."""

    COLWISE = "colwise"  # output features sharded; input replicated
    ROWWISE = "rowwise"  # input features sharded; output all-reduced (or reduce-scattered)
    VOCAB = "vocab"  # embedding table sharded along the vocabulary (rowwise over num_embeddings)
    SEQUENCE = "sequence"  # norm / dropout run on sequence shards (sequence parallel)
    REPLICATE = "replicate"  # kept whole on every TP rank


class LoweringKind(str, enum.Enum):
    """The data-parallel lowering of one pipeline stage (docs/runtime.md, "What each kind holds")."""

    NONE = "none"
    """One replica, nothing to wrap."""
    DDP = "ddp"
    """``DistributedDataParallel``: every rank holds whole parameters, gradients, optimizer states."""
    ZERO1 = "ddp+zero_redundancy_optimizer"
    """DDP with ``ZeroRedundancyOptimizer``: optimizer states partitioned by whole tensors."""
    FSDP = "fsdp2"
    """FSDP2 ``fully_shard``: parameters, gradients and optimizer states sharded over the dp axis."""
