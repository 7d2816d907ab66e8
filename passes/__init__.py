"""FX graph passes: capture a model, annotate, count FLOPs and bytes, find blocks and TP patterns.

Each pass is a function over a ``torch.fx.GraphModule`` that records its results in
``node.meta["whalepy.<key>"]`` (graph-wide ones in ``gm.meta``); :func:`run_passes` orders them and
names the pass and node when one fails. :func:`build_profile` runs the whole pipeline and returns a
:class:`whalepy.ir.profile.ModelProfile`. See docs/profiling.md.
"""

from whalepy.passes.capture import capture, normalize_inputs, run_captured
from whalepy.passes.grouping import BlockSpec, find_runs
from whalepy.passes.manager import PassContext, run_passes
from whalepy.passes.profile import analysis_passes, build_profile, model_fingerprint
from whalepy.passes.tp_patterns import TP_DEGREES, BlockTP, check_split_degrees

__all__ = [
    "TP_DEGREES",
    "BlockSpec",
    "BlockTP",
    "PassContext",
    "analysis_passes",
    "build_profile",
    "capture",
    "check_split_degrees",
    "find_runs",
    "model_fingerprint",
    "normalize_inputs",
    "run_captured",
    "run_passes",
]
