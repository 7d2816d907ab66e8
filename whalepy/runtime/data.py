"""What each rank reads: the data contract of a parallel training job.

A plan splits every global batch of ``B`` samples over its ``dp`` replicas in ``plan.batch_shares``
(uneven on mixed clusters): replica ``r`` trains on rows ``sum(shares[:r]) : sum(shares[:r + 1])`` of
it. Every rank of a replica (its tensor-parallel ranks and its pipeline stages) belongs to that share,
but only some of them need the data:

- the ranks of the **first** pipeline stage feed the model: they need the **inputs**;
- the ranks of the **last** pipeline stage compute the loss: they need the **targets**;
- with one stage, every rank needs both; ranks of a middle stage need neither.

:class:`LocalShare` (``pm.local_share``) says this for the calling rank; :class:`ShardedBatchSampler`
(``pm.batch_sampler(...)``) yields, step after step, the dataset indices of that rank's share, so a
plain ``DataLoader(dataset, batch_sampler=...)`` or torchdata's ``StatefulDataLoader`` reads only them.
Its order is a function of ``(seed, epoch)`` alone, the same on every rank, and the rows a replica
reads are exactly the rows it would slice from the global batch: training on the local shares
computes what training on global batches computes.

The sampler's position is its state (``state_dict()`` / ``load_state_dict()``: epoch and batches
consumed in it), so it resumes where a checkpoint left it; any loader that implements the same two
methods (torchdata's ``StatefulDataLoader`` does, and asks the sampler for its state) can be passed to
``pm.save(path, loader=...)`` / ``pm.load(path, loader=...)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from whalepy.errors import ArgumentError

__all__ = ["LocalShare", "ShardedBatchSampler"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalShare:
    """The part of every global batch the calling rank trains on, and what it must read of it."""

    replica: int
    """This rank's data-parallel replica (its index in ``plan.batch_shares``)."""
    num_replicas: int
    """The plan's data-parallel degree."""
    start: int
    """First row of the global batch this replica trains on."""
    size: int
    """Rows of each global batch this replica trains on (``plan.batch_shares[replica]``)."""
    global_batch: int
    """Samples per global batch (all replicas)."""
    needs_inputs: bool
    """This rank runs the first pipeline stage (or the only one): it must be given the inputs."""
    needs_targets: bool
    """This rank runs the last pipeline stage (or the only one): it must be given the targets."""

    @property
    def reads_data(self) -> bool:
        """False on the ranks of a middle pipeline stage: they may pass ``train_step(None, None)``."""
        return self.needs_inputs or self.needs_targets

    def slice(self, x: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a global batch tensor (dim 0 of ``global_batch`` samples)."""
        return x[self.start:self.start + self.size]


class _ShardIter:
    """One epoch of a :class:`ShardedBatchSampler`, resumable: its state is the sampler's."""

    def __init__(self, sampler: ShardedBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> _ShardIter:
        return self

    def __next__(self) -> list[int]:
        s = self.sampler
        if s.batch >= len(s):
            s.epoch, s.batch = s.epoch + 1, 0  # the next iter() starts the next epoch
            raise StopIteration
        out = s.indices_of(s.epoch, s.batch)
        s.batch += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


class ShardedBatchSampler:
    """Dataset indices of one replica's share of each global batch (a ``batch_sampler`` for a
    ``DataLoader``). Usually made by ``pm.batch_sampler(dataset)``.

    An epoch is ``num_samples // global_batch`` global batches (the remainder is dropped, as every
    step trains a full global batch); with ``shuffle`` the samples are permuted by a generator seeded
    with ``seed + epoch`` (the same permutation on every rank). Iterating yields the epoch's batches
    from the current position on; at its end the next ``iter()`` starts the next epoch."""

    def __init__(self, num_samples: int, share: LocalShare, *, shuffle: bool = True, seed: int = 0) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < share.global_batch:
            raise ArgumentError(f"batch_sampler: the dataset has {num_samples!r} samples, fewer than one global batch "
                                f"({share.global_batch}); give a dataset (or its length) of at least that many")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ArgumentError(f"batch_sampler(seed={seed!r:.40}): give an integer")
        self.num_samples = num_samples
        self.share = share
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.batch = 0

    def __len__(self) -> int:
        return self.num_samples // self.share.global_batch

    def indices_of(self, epoch: int, batch: int) -> list[int]:
        """This replica's indices of global batch ``batch`` of ``epoch``."""
        b, s = self.share.global_batch, self.share
        lo = batch * b + s.start
        if not self.shuffle:
            return list(range(lo, lo + s.size))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)[lo:lo + s.size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return _ShardIter(self)

    def state_dict(self) -> dict[str, int]:
        """The position: epoch and global batches consumed in it (the same on every rank), and what the
        order depends on (checked on load)."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "num_samples": self.num_samples,
                "global_batch": self.share.global_batch, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "num_samples", "global_batch", "shuffle"):
            mine = int(self.state_dict()[key])
            if key in state and int(state[key]) != mine:
                raise ArgumentError(f"the data position being restored was saved with {key}={state[key]}, this "
                                    f"sampler has {key}={mine}: the order of the samples would differ; build the "
                                    "sampler as the saved run did")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


def local_share(plan: Any, replica: int, stage_indices: Sequence[int], num_stages: int) -> LocalShare:
    """The :class:`LocalShare` of a rank of ``replica`` running pipeline stages ``stage_indices``."""
    shares = plan.batch_shares
    return LocalShare(replica=replica, num_replicas=len(shares), start=sum(shares[:replica]),
                      size=shares[replica], global_batch=plan.global_batch,
                      needs_inputs=0 in stage_indices, needs_targets=num_stages - 1 in stage_indices)


def dataset_length(dataset: Any) -> int:
    """``len(dataset)``, or ``dataset`` itself when it is a count."""
    if isinstance(dataset, int) and not isinstance(dataset, bool):
        return dataset
    try:
        return len(dataset)
    except TypeError:
        raise ArgumentError(f"batch_sampler() takes a map-style dataset (with len()) or its number of samples, got "
                            f"{type(dataset).__name__}; an iterable dataset must shard itself: read rows "
                            "pm.local_share.start : start + size of each global batch") from None


def take_local(what: str, inputs: Any, targets: Any, share: LocalShare,
               check_inputs: Any) -> tuple[tuple, torch.Tensor | None]:
    """``train_step`` / ``evaluate``'s batch as this rank's share: tensors of the global batch are sliced,
    tensors of the local share taken as they are; ``None`` where this rank needs no inputs (not the
    first pipeline stage) or no targets (not the last)."""
    from whalepy.runtime._pm_helpers import _as_tuple

    for value, needed, name, stage in ((inputs, share.needs_inputs, "inputs", "first"),
                                       (targets, share.needs_targets, "targets", "last")):
        if value is None and needed:
            raise ArgumentError(f"{what}({'None' if name == 'inputs' else 'inputs'}, "
                                f"{'None' if name == 'targets' else 'targets'}): this rank runs the {stage} pipeline "
                                f"stage and needs the {name}; pm.local_share says what each rank reads")
    ins = () if inputs is None else _as_tuple(inputs)
    if inputs is not None:
        check_inputs(ins)
    given = [*ins, *([] if targets is None else [targets])]
    for x in given:
        if not isinstance(x, torch.Tensor):
            raise ArgumentError(f"{what} got a {type(x).__name__} where a tensor is expected; pass the batch's "
                                "inputs and targets as tensors")
    rows = {x.shape[0] if x.dim() else None for x in given}
    if rows - {share.global_batch, share.size} or len(rows) > 1:
        bad = next((x for x in given if (x.shape[0] if x.dim() else None) not in (share.global_batch, share.size)),
                   given[-1])
        raise ArgumentError(
            f"{what} got a tensor of shape {tuple(bad.shape)}; every rank passes the whole global batch "
            f"({share.global_batch} samples along dim 0; whalepy takes this replica's share) or this replica's "
            f"share ({share.size} samples, rows {share.start}:{share.start + share.size}: pm.local_share, "
            "pm.batch_sampler), the same for inputs and targets")
    if rows == {share.global_batch} and share.size != share.global_batch:
        ins = tuple(share.slice(x) for x in ins)
        targets = share.slice(targets) if targets is not None else None
    return ins, targets
