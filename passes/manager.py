"""A tiny pass manager: runs analysis passes in order and names the pass and node that failed.

A pass is a function ``fn(gm, ctx) -> None`` that records its results in ``node.meta`` under
``"whalepy.<key>"`` (graph-wide results go to ``gm.meta``). Passes walk the graph with
``ctx.nodes(gm)`` so that, when one raises, the manager knows the node it was looking at and can
say so (as torch/fx/passes/infra/pass_manager.py does). Errors that whalepy raises on purpose
(``AnnotationError`` and friends) are user errors with their own message and pass through
unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from whalepy.errors import CaptureError, WhalepyError


@dataclass(slots=True)
class PassContext:
    """What a running pass shares with the manager: the node it is at."""

    node: fx.Node | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def nodes(self, gm: fx.GraphModule) -> Iterator[fx.Node]:
        """Iterate over ``gm``'s nodes in order, remembering the current one for error messages."""
        for node in gm.graph.nodes:
            self.node = node
            yield node
        self.node = None


Pass = Callable[[fx.GraphModule, PassContext], Any]


def describe_node(node: fx.Node) -> str:
    path = node.meta.get("whalepy.module_path")
    where = f" in {path}" if path else ""
    return f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)}{where})"


def run_passes(gm: fx.GraphModule, passes: Sequence[tuple[str, Pass]]) -> dict[str, float]:
    """Run ``passes`` (``(name, fn)`` pairs) over ``gm`` in order; return seconds per pass.

    The timings also go to ``gm.meta["whalepy.pass_times"]``.
    """
    ctx = PassContext()
    for name, fn in passes:
        ctx.node = None
        start = time.perf_counter()
        try:
            fn(gm, ctx)
        except WhalepyError:
            raise
        except Exception as e:
            node = describe_node(ctx.node) if ctx.node is not None else "<whole graph>"
            raise CaptureError(f"pass {name} failed at node {node}: {type(e).__name__}: {e}") from e
        ctx.timings[name] = time.perf_counter() - start
    gm.meta.setdefault("whalepy.pass_times", {}).update(ctx.timings)
    return dict(ctx.timings)
