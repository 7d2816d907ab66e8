"""Lowering a :class:`~whalepy.Plan` onto PyTorch's distributed stack: DeviceMesh, DTensor tensor
parallelism, ``torch.distributed.pipelining``, FSDP2 / DDP / ZeroRedundancyOptimizer, activation
checkpointing and distributed checkpoints. Entry point: :func:`parallelize`."""

from whalepy.runtime.data import LocalShare, ShardedBatchSampler
from whalepy.runtime.mesh import RankMeshes, build_meshes, make_plan
from whalepy.runtime.metrics import JsonlSink, TensorBoardSink, WandbSink
from whalepy.runtime.parallel_model import (
    ParallelModel,
    UnlaunchedModel,
    is_distributed_launch,
    parallelize,
)
from whalepy.runtime.periodic import Checkpointer

__all__ = [
    "ParallelModel",
    "RankMeshes",
    "UnlaunchedModel",
    "build_meshes",
    "is_distributed_launch",
    "make_plan",
    "parallelize",
    "Checkpointer",
    "JsonlSink",
    "LocalShare",
    "ShardedBatchSampler",
    "TensorBoardSink",
    "WandbSink",
]
