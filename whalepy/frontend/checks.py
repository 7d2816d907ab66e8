"""Argument checks that run first, before any capture, planning or lowering.

Every public entry point (``plan``, ``profile``, ``estimate``, ``parallelize``, ``train_step``, the
CLI) calls these on its arguments, so a mistake costs nothing and reads as one line naming the cause and
the fix (an :class:`~whalepy.errors.ArgumentError` or another whalepy error), never a traceback from
deep inside torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from whalepy.errors import ArgumentError, ClusterSpecError

__all__ = ["as_cluster", "check_model", "check_example_inputs", "max_positions", "check_positive_int",
           "check_scalar_loss", "first_embedding", "token_dtype_hint", "check_nvme_dir", "token_vocab",
           "check_token_ids"]

_POSITION_FIELDS = ("block_size", "n_positions", "max_position_embeddings")
"""Config fields that bound the sequence length: whalepy's GPTConfig, HF GPT-2, HF Llama / BERT."""


def as_cluster(cluster: Any, where: str) -> Any:
    """A :class:`~whalepy.ClusterSpec` from a spec, a path to a YAML / JSON spec or a dict."""
    from whalepy.hardware.cluster import ClusterSpec

    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, (str, os.PathLike)):
        return ClusterSpec.load(cluster)
    if isinstance(cluster, Mapping):
        return ClusterSpec.from_dict(cluster)
    raise ClusterSpecError(
        f"{where}: the cluster is a {type(cluster).__name__} ({cluster!r:.60}); pass a whalepy.ClusterSpec, "
        "the path of a YAML / JSON spec (e.g. 'examples/clusters/cpu4.yaml') or a dict of one")


def check_model(model: Any, where: str) -> None:
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        hint = " (a built-in name works on the command line: `whalepy plan NAME ...`)" if isinstance(model, str) else ""
        raise ArgumentError(f"{where} needs a torch.nn.Module, got {type(model).__name__} {model!r:.60}{hint}; "
                            "build the model first and pass it")
    if next(model.parameters(), None) is None:
        raise ArgumentError(f"{where}: {type(model).__name__} has no parameters, so there is nothing to train, "
                            "shard or place; pass the model whose weights you train (its modules registered as "
                            "attributes or in nn.ModuleList, not a plain Python list)")


def max_positions(model: Any) -> tuple[int, str] | None:
    """``(longest sequence, "config.FIELD")`` for a model with a learned position table (an
    ``nn.Embedding`` of that many rows, as GPT-2 and BERT have), or None: rotary models (Llama) take longer
    sequences than their config's ``max_position_embeddings``."""
    import torch.nn as nn

    cfg = getattr(model, "config", None)
    for name in _POSITION_FIELDS:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            if any(isinstance(m, nn.Embedding) and m.num_embeddings == value for m in model.modules()):
                return value, f"config.{name}"
            return None
    return None


def _describe(x: Any) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    return type(x).__name__


def check_example_inputs(model: Any, example_inputs: Any, where: str) -> None:
    """Example inputs are tensors (a tensor, a tuple / list of them, or a dict of keyword inputs), with a
    batch, no longer than the model's learned positions."""
    import torch

    if example_inputs is None:
        raise ArgumentError(f"{where}: example_inputs is None; pass the model's inputs for one sample, e.g. "
                            "example_inputs=(torch.zeros(1, 1024, dtype=torch.long),)")
    if isinstance(example_inputs, Mapping):
        items = list(example_inputs.items())
    elif isinstance(example_inputs, (tuple, list)):
        items = [(f"example_inputs[{i}]", x) for i, x in enumerate(example_inputs)]
    else:
        items = [("example_inputs", example_inputs)]
    if not items:
        raise ArgumentError(f"{where}: example_inputs is empty; pass the model's inputs, e.g. (tokens,)")
    tensors = []
    for name, x in items:
        if isinstance(x, torch.Tensor):
            tensors.append((name, x))
        elif x is not None and not isinstance(x, (bool, int, float, str)):
            raise ArgumentError(f"{where}: {name} is a {type(x).__name__}, not a tensor; pass tensors, e.g. "
                                "torch.tensor(...) of the shape and dtype the model's forward takes")
    if not tensors:
        return
    limit = max_positions(model)
    for name, x in tensors:
        if limit is not None and not x.is_floating_point() and x.dim() >= 2 and x.shape[1] > limit[0]:
            raise ArgumentError(
                f"{where}: {name} has {x.shape[1]} tokens per sample but {type(model).__name__} has "
                f"{limit[0]} positions ({limit[1]}); shorten the inputs to at most {limit[0]} tokens, or build "
                "the model with more positions")
        if x.dim() >= 1 and x.shape[0] == 0:
            raise ArgumentError(f"{where}: {name} has an empty batch dimension ({_describe(x)}); give at "
                                "least one sample")
    first = tensors[0] if items[0][1] is tensors[0][1] else None
    if first is not None and not first[1].is_floating_point():  # float ids: told after the capture (token_dtype_hint)
        check_token_ids(first[1], token_vocab(model), where, first[0])


def token_dtype_hint(model: Any, example_inputs: Any) -> ArgumentError | None:
    """After a failed capture: the error to raise instead when the first input is floating point and the
    model starts with an embedding (token ids expected). Not checked before the capture: a model may
    register a position embedding first and take float features."""
    first = example_inputs[0] if isinstance(example_inputs, (tuple, list)) and example_inputs else example_inputs
    embed = first_embedding(model)
    if embed is None or not getattr(first, "is_floating_point", lambda: False)():
        return None
    return ArgumentError(
        f"the model could not be captured: the first example input is {_describe(first)} but {type(model).__name__} starts with an "
        f"embedding ({embed}) that takes integer token ids; pass e.g. torch.zeros{tuple(first.shape)}.long()")


def token_vocab(model: Any) -> tuple[int, str] | None:
    """``(rows, path)`` of the model's token embedding, which its first input (token ids ``0 .. rows - 1``)
    goes through: the one of ``config.vocab_size`` rows, else the model's only embedding; None when it is
    not clear which embedding takes the first input (a position table registered first, several tables)."""
    import torch.nn as nn

    embeddings = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Embedding)]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    chosen = [(p, m) for p, m in embeddings if m.num_embeddings == vocab] if isinstance(vocab, int) else []
    chosen = chosen or (embeddings if len(embeddings) == 1 and first_embedding(model) is not None else [])
    return (chosen[0][1].num_embeddings, chosen[0][0]) if chosen else None


def check_token_ids(x: Any, vocab: tuple[int, str] | None, where: str, name: str) -> None:
    """Token ids in ``x`` (a model's first input) fit the embedding ``vocab`` (:func:`token_vocab`): an
    id outside it fails deep inside ``F.embedding`` on the CPU and as a device-side assert on a GPU.
    Checked on CPU tensors only (reading a GPU tensor's range would synchronise every step)."""
    import torch

    if vocab is None or not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.numel() == 0:
        return
    rows, path = vocab
    if x.is_floating_point():
        raise ArgumentError(f"{where}: {name} is {_describe(x)} but the model starts with an embedding ({path}) that "
                            "takes integer token ids; pass e.g. tokens.long()")
    if x.dtype is torch.bool or x.is_complex():
        return
    from torch._guards import detect_fake_mode

    if detect_fake_mode(x) is not None:  # a dry run without values (whalepy check): no range to read
        return
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= rows:
        raise ArgumentError(f"{where}: {name} holds token id {low if low < 0 else high} but the embedding {path} has "
                            f"{rows} rows (ids 0 to {rows - 1}); tokenize with the model's own vocabulary, or build "
                            "the model with a larger vocab_size")


def first_embedding(model: Any) -> str | None:
    """Path of the first registered leaf module when it is an ``nn.Embedding`` (a token embedding)."""
    import torch.nn as nn

    for path, mod in model.named_modules():
        if next(mod.children(), None) is None:
            return path if path and isinstance(mod, nn.Embedding) else None
    return None


def check_positive_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"{where}: {name} must be a positive integer, got {value!r}; pass e.g. {name}=8")
    return value


def check_scalar_loss(loss: Any) -> None:
    """``loss_fn``'s result is a one-element tensor (the mean loss of the samples it was given)."""
    import torch

    if not isinstance(loss, torch.Tensor):
        raise ArgumentError(f"loss_fn returned a {type(loss).__name__}, not a tensor; return the mean loss as a "
                            "scalar tensor, e.g. F.cross_entropy(logits.flatten(0, 1), targets.flatten())")
    if loss.numel() != 1:
        raise ArgumentError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar; reduce it to the mean loss "
            "(e.g. .mean(), or F.cross_entropy with its default reduction='mean')")
    if not (loss.is_floating_point() or loss.is_complex()):
        raise ArgumentError(f"loss_fn returned a {loss.dtype} tensor; a loss to differentiate is floating point")


def check_nvme_dir(nvme_dir: Any, keep: Any, *, on_node: bool, where: str = "whalepy.parallelize()") -> None:
    """``parallelize(nvme_dir=..., nvme_keep=...)``: the types always; ``on_node`` (inside a launch, where
    the files will be written) also that the directory is one, or can be created, and is writable (its
    free space, summed over the ranks writing there: :mod:`whalepy.runtime.disk_space`). Touches nothing
    on disk: the disk tier creates and probes the directory itself when it is built (docs/runtime.md,
    "Disk tier")."""
    import tempfile
    from pathlib import Path

    if nvme_dir is not None and (not isinstance(nvme_dir, (str, os.PathLike)) or not os.fspath(nvme_dir)):
        said = "an empty path" if isinstance(nvme_dir, str) else f"a {type(nvme_dir).__name__}"
        raise ArgumentError(f"{where}: nvme_dir={nvme_dir!r:.60} is {said}; pass the path of a "
                            "directory on the node's NVMe drive, e.g. nvme_dir='/local_nvme/whalepy'")
    if not isinstance(keep, bool):
        raise ArgumentError(f"{where}: nvme_keep={keep!r:.60} must be True (keep the files to resume) or False")
    if not on_node:
        return
    path = Path(nvme_dir if nvme_dir is not None else tempfile.gettempdir())
    shown = f"nvme_dir {os.fspath(path)!r}"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ArgumentError(f"{where}: {shown}: {os.fspath(existing)!r} is a file, not a directory; pass a "
                            "directory on the node's NVMe drive (it is created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ArgumentError(f"{where}: {shown} is not writable ({os.fspath(existing)!r} does not let this user "
                            "create files); pass a writable directory on the node's NVMe drive")


def _lowered(model: Any) -> bool:
    """The model was rewritten by ``parallelize`` on this rank (FSDP2 units, DTensor parameters): its class
    names and shapes are the runtime's, so its fingerprint is not the captured model's. The closed loop
    re-plans such a model from ``pm.measured_profile()`` (docs/runtime.md); the plan was checked against
    the model before lowering."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(q, DTensor) for q in model.parameters())


def check_profile_of_model(profile: Any, model: Any, where: str) -> None:
    """``plan(model, profile=...)`` / ``parallelize(profile=...)``: the profile is this model's (module
    paths, parameter shapes and dtypes: the fingerprint). A plan made from another model's profile would
    place blocks this model lacks or miss ones it has; refused before planning, and cheap (no capture)."""
    import torch

    if profile is None or not isinstance(model, torch.nn.Module) or _lowered(model):
        return
    from whalepy.passes.profile import model_fingerprint

    theirs, ours = getattr(profile, "fingerprint", None), model_fingerprint(model)
    if theirs != ours:
        raise ArgumentError(f"{where}: the profile is of model {getattr(profile, 'model_name', '?')!r} "
                            f"(fingerprint {theirs}), the model given has fingerprint {ours}: their module paths, "
                            "parameter shapes or dtypes differ; pass whalepy.profile(model, example_inputs) of this "
                            "model, or leave profile out")
