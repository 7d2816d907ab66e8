"""What ``parallelize`` keeps of a pseudo model (layers tied by ``whalepy.pseudo_to_real``) so that
``whalepy.delink`` can build the real one: the mark the tie leaves on the model, and a meta-device copy
with the launch arguments, recorded before lowering changes the model. Plain data; the feature itself
(tie, delink) is ``whalepy.tools.pseudo_to_real``, above the runtime, which the runtime never imports.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PseudoBuild", "PseudoLayers", "meta_copy", "pseudo_layers", "record_pseudo"]

PSEUDO_MARK = "_whalepy_pseudo_layers"
"""The attribute `whalepy.pseudo_to_real` sets on a model whose layers it tied."""


@dataclass(frozen=True, slots=True)
class PseudoLayers:
    """What ``whalepy.pseudo_to_real`` tied: the layer container's module path and its length."""

    path: str
    num_layers: int


@dataclass(frozen=True, slots=True)
class PseudoBuild:
    """What ``parallelize`` keeps of a pseudo model so that ``whalepy.delink`` can build the real one:
    a meta-device copy made before lowering, and the arguments it was lowered with."""

    layers: PseudoLayers
    skeleton: nn.Module
    cluster_spec: Any
    example_inputs: tuple
    optimizer_factory: Any
    nvme_dir: Any


def record_pseudo(model: nn.Module, **arguments: Any) -> PseudoBuild | None:
    """For ``parallelize``: a :class:`PseudoBuild` of ``model`` if it is a pseudo model, else ``None``
    (call it before lowering changes the model)."""
    info = pseudo_layers(model)
    return None if info is None else PseudoBuild(layers=info, skeleton=meta_copy(model), **arguments)


def pseudo_layers(model: nn.Module) -> PseudoLayers | None:
    """The tied layers of a pseudo model, or ``None`` for any other model."""
    return getattr(model, PSEUDO_MARK, None)


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every parameter and buffer on the meta device (no memory), ties
    kept: the skeleton ``whalepy.delink`` builds the real model from after lowering changed ``model``."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(
                t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)
