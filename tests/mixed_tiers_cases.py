"""Per-rank workers for the mixed-tier tests (no tests here): one stage whose blocks have different
memory tiers (granular offloading, as M6-10T's), written by hand with ``make_plan(tiers=...)``.

The measurements are those of the disk-tier tests (:func:`infinity_cases.infinity_case`: losses and
parameters against the single-process run; bytes held on device, host and in files against the memory
model, here :func:`~whalepy.cost_models.memory.estimate_stage_model_state_bytes` of the stage's blocks
with their own tiers) and of the checkpoint tests (:func:`runtime_cases.run_resume`: two steps, DCP
save, a differently initialised model under the same plan loads and trains the third step).
"""

from __future__ import annotations

from typing import Any

from infinity_cases import infinity_case
from runtime_cases import Case, run_resume

GPT4 = ("embed", "transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3", "head")
"""The blocks of the 4-layer GPT (``runtime_cases.gpt_model``) in model order."""


def tiers(*pairs: str) -> dict[str, tuple[str, str]]:
    """``{block: (param_tier, optimizer_tier)}`` of :data:`GPT4` from ``"param/optimizer"`` strings."""
    return {name: tuple(pair.split("/")) for name, pair in zip(GPT4, pairs, strict=True)}  # type: ignore[misc]


def mixed_cases(cases: list[Any], root: str) -> list[dict[str, Any]]:
    """Each item: a :class:`Case` (:func:`infinity_case`) or ``("resume", first, second, name)``
    (:func:`run_resume`, its checkpoint under ``root``)."""
    import os
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    out = []
    for c in cases:
        if isinstance(c, tuple):
            _, first, second, name = c
            out.append(run_resume(first, second, os.path.join(root, name)))
        else:
            out.append(infinity_case(c, root))
    return out
