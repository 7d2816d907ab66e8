"""Export a training checkpoint as HF safetensors: ``whalepy export CKPT_DIR --to OUT_DIR``.

The checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory written by
``ParallelModel.save`` under any plan. DCP re-shards on load, so reading it whole needs no process group
(``dcp.load(..., no_dist=True)``) and no knowledge of the plan: each output shard's tensors are read
into full-size tensors, written with ``safetensors.torch.save_file`` and dropped before the next shard
(peak memory: one output shard). The output is what ``save_pretrained`` writes: ``config.json``, one
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards with
``model.safetensors.index.json``; tied weights are stored once, under the first name the HF model
gives them (``lm_head.weight`` of a tied model is left out, as ``save_pretrained`` does).
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from whalepy.errors import WhalepyError

from whalepy.runtime.model_config import WHALEPY_MODEL_KEY, build_whalepy_model

log = logging.getLogger(__name__)

__all__ = ["export_safetensors", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """``5GB``, ``500MiB``, ``1000`` -> bytes (a positive number)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper()) if isinstance(size, str) else None
    value = size if isinstance(size, int) and not isinstance(size, bool) else (
        int(float(m.group(1)) * _UNITS[m.group(2) or ""]) if m else None)
    if value is None or value < 1:
        raise WhalepyError(f"shard size {size!r} is not a positive size; write e.g. 5GB, 500MB or 1000000")
    return value


def _config_dict(checkpoint: Path, config: Any) -> dict[str, Any]:
    if config is None:
        path = checkpoint / "config.json"
        if not path.is_file():
            raise WhalepyError(
                f"{checkpoint} holds no config.json (ParallelModel.save writes it for an HF model and for "
                "whalepy.models.GPT); pass the model's HF config: --config config.json (or config= in Python)")
        return _read_config(path)
    if isinstance(config, Mapping):
        return dict(config)
    if callable(getattr(config, "to_dict", None)):
        return config.to_dict()
    if not isinstance(config, (str, Path)):
        raise WhalepyError(f"config={config!r:.60}: give the HF config as a dict, a config object or the path of "
                           "its config.json")
    return _read_config(Path(config))


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise WhalepyError(f"cannot read the config {str(path)!r}: {e.strerror}; give the model's HF "
                           "config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WhalepyError(f"the config {str(path)!r} is not valid JSON ({e}); give the model's HF config.json") from None
    if not isinstance(data, dict):
        raise WhalepyError(f"the config {str(path)!r} holds a {type(data).__name__}, not a JSON object; give the "
                           "model's HF config.json")
    return data


def _checkpoint_tensors(checkpoint: Path) -> tuple[dict[str, Any], bool]:
    """Model tensor name -> DCP metadata, and whether the names sit under ``model.``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from whalepy.runtime.dcp_files import read_metadata

    entries = read_metadata(checkpoint).state_dict_metadata
    tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
    nested = any(k.startswith("model.") for k in tensors)
    if nested:
        tensors = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    return tensors, nested


def _hf_names(out_dir: Path, cfg: dict[str, Any]) -> tuple[set[str], dict[str, str]] | None:
    """The state dict keys the HF model of ``cfg`` saves, and each tied alias -> its first name, from
    the model built on the meta device; None without transformers or an ``architectures`` entry. A
    whalepy model (:data:`WHALEPY_MODEL_KEY`) saves every key, tied ones included (``load_state_dict``
    of the model then takes the file as it is)."""
    if WHALEPY_MODEL_KEY in cfg:
        return set(build_whalepy_model(cfg, "meta").state_dict()), {}
    try:
        import transformers
    except ImportError:
        return None
    archs = cfg.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        log.warning("whalepy export: the config names no transformers model class (architectures); "
                    "tensors are written as stored, tied weights under every name, unchecked")
        return None
    config = transformers.AutoConfig.from_pretrained(str(out_dir))
    with torch.device("meta"):
        model = cls(config)
    first: dict[int, str] = {}
    alias = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            alias[name] = first[id(p)]
    keys = set(model.state_dict().keys()) - set(alias)
    return keys, alias


def export_safetensors(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    config: Any = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write the model weights of the DCP ``checkpoint`` to ``out_dir`` as HF safetensors (see the
    module docstring); return the files written. ``config``: the HF config (a dict, a config object or
    a ``config.json`` path), by default the ``config.json`` in the checkpoint. ``dtype`` converts
    floating-point tensors (default: as stored, fp32 master weights)."""
    from whalepy.files import atomic_path, check_output, write_file
    from whalepy.runtime.commit import resolve, verify
    from whalepy.runtime.dcp_files import load_files

    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise WhalepyError("export needs the safetensors package: pip install 'whalepy[hf]'") from e
    if not isinstance(out_dir, (str, Path)):
        raise WhalepyError(f"out_dir={out_dir!r:.60}: give the path of the directory to write")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise WhalepyError(f"dtype={dtype!r:.60}: give a floating-point torch.dtype (torch.bfloat16, torch.float16, "
                           "torch.float32), or None to keep the stored dtype")
    limit = parse_size(max_shard_size)
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise WhalepyError(f"{out_dir} is a file; export writes a directory: give a new or existing directory")
    tensors, nested = _checkpoint_tensors(checkpoint)
    given, checkpoint = checkpoint, resolve(checkpoint)  # after a crash inside a commit: the complete sibling
    out_dir = check_output(out_dir, inputs=(given, checkpoint), what="export --to", directory=True)
    if isinstance(config, (str, Path)):
        check_output(out_dir / "config.json", inputs=(), what="export --to")
        if Path(config).resolve() == (out_dir / "config.json").resolve():
            config = _read_config(Path(config))  # read before it is rewritten in place
    cfg = _config_dict(checkpoint, config)
    verify(checkpoint, distributed=False)  # every file against its checksum, once, before a byte is written
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WhalepyError(f"export --to {out_dir}: cannot create it ({e.strerror or e}); give a writable "
                           "directory") from None
    before = {p.name for p in out_dir.glob("model*.safetensors*")}
    write_file(out_dir / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n", what="export --to")
    hf = _hf_names(out_dir, cfg)
    if hf is not None:
        keys, alias = hf
        tensors = {k: v for k, v in tensors.items() if k not in alias}
        missing, extra = sorted(keys - set(tensors)), sorted(set(tensors) - keys)
        if missing or extra:
            arch = cfg[WHALEPY_MODEL_KEY] if WHALEPY_MODEL_KEY in cfg else cfg["architectures"][0]
            raise WhalepyError(
                f"the checkpoint does not match {arch}: "
                + (f"it lacks {missing[:3]} ({len(missing)} in all)" if missing else "")
                + ("; " if missing and extra else "")
                + (f"{arch} has no {extra[:3]} ({len(extra)} in all)" if extra else "")
                + "; pass the config of the model that was trained (--config)")

    def out_dtype(meta: Any) -> torch.dtype:
        stored = meta.properties.dtype
        return dtype if dtype is not None and stored.is_floating_point else stored

    shards: list[list[str]] = [[]]
    size = 0
    for name, meta in tensors.items():
        nbytes = meta.size.numel() * out_dtype(meta).itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    files, weight_map, total = [], {}, 0
    for i, names in enumerate(shards):
        state = {k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype) for k in names}
        with warnings.catch_warnings():  # DCP warns that it loads in one process, as asked
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
            load_files({"model": state} if nested else state, checkpoint, no_dist=True, verified=True)
        state = {k: v.to(out_dtype(tensors[k])).contiguous() for k, v in state.items()}
        file = out_dir / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
        with atomic_path(file, what="export --to") as tmp:
            save_file(state, str(tmp), metadata={"format": "pt"})
        files.append(file)
        weight_map.update({k: file.name for k in names})
        total += sum(v.nbytes for v in state.values())
        del state
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_file(out_dir / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n", what="export --to")
    # an earlier export's weights left beside these would be what from_pretrained finds first
    written = {f.name for f in files} | ({"model.safetensors.index.json"} if n > 1 else set())
    for stale in sorted(before - written):
        (out_dir / stale).unlink(missing_ok=True)
    return files
