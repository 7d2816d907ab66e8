"""Where a model's training step peaks, and what is alive there, without a GPU: the step of
``bench_gpu_step.py`` (bf16 autocast over fp32 parameters, ``F.cross_entropy(logits.float())``, AdamW,
two steps so that Adam's states exist) replayed at full size on fake tensors, with every tensor an
operator returns counted until its storage is freed (allocations rounded up to the CUDA caching
allocator's 512 bytes). Fake tensors hold no memory, so the 1.2B Llama's 30 GiB step replays in about
half a minute on a CPU.

    python benchmarks/replay_peak.py llama            # or gpt; --optimizer foreach|fused|for-loop

It replays on the CPU device (this machine's torch has no CUDA): CPU autocast casts the same operators
of these models to bf16 as CUDA autocast does (linear/matmul, SDPA; the loss is fp32 by ``.float()``),
and SDPA runs the CPU flash kernel, which saves what the CUDA kernels save for backward (output and
log-sum-exp) but not necessarily the same bytes for grouped-query attention. ``--optimizer foreach``
(CUDA's default, which the CPU does not default to) steps with torch's multi-tensor AdamW.
docs/cost_model.md ("Validation: one H200") compares the result with the H200 run and the model.
"""

from __future__ import annotations

import argparse
import collections
import sys
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))

import h200_check  # noqa: E402

GIB = 2**30
CUDA_MIN_BLOCK = 512
"""The CUDA caching allocator rounds every allocation up to a multiple of 512 bytes (``kMinBlockSize``,
c10/cuda/CUDACachingAllocator.cpp); ``max_memory_allocated`` counts the rounded sizes."""


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive, their peak and what was alive at it: every storage an operator
    returns, until it is freed (a weak reference's callback)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.live: dict[int, tuple[int, tuple]] = {}
        self.now = self.peak = 0
        self.at_peak: dict[int, tuple[int, tuple]] = {}
        self.peak_op = ""
        self.phase_peak: dict[str, int] = collections.defaultdict(int)

    def add(self, storage: torch.UntypedStorage, what: tuple) -> None:
        key = id(storage)
        if key in self.live:
            return
        size = -(-storage.nbytes() // CUDA_MIN_BLOCK) * CUDA_MIN_BLOCK
        self.live[key] = (size, what)
        self.now += size
        weakref.finalize(storage, self._free, key)
        self.phase_peak[self.phase] = max(self.phase_peak[self.phase], self.now)
        if self.now > self.peak:
            self.peak, self.at_peak, self.peak_op = self.now, dict(self.live), f"{self.phase}: {what[1]}"

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)[0]

    def reset_peak(self) -> None:
        self.peak, self.phase_peak = self.now, collections.defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t.untyped_storage(), (self.phase, str(func), str(t.dtype).removeprefix("torch.")))
        return out


def _on_fake_device(model: torch.nn.Module) -> None:
    """The meta model's parameters and buffers as fake CPU tensors, ties kept."""
    made: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for k, p in mod._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                mod._parameters[k] = made[id(p)]
        for k, b in mod._buffers.items():
            if b is not None:
                mod._buffers[k] = torch.empty(b.shape, dtype=b.dtype)


def replay(name: str, optimizer: str = "foreach", steps: int = 2) -> LiveBytes:
    """The step of ``name`` (``gpt`` or ``llama``, ``h200_check.build``) replayed ``steps`` times; the
    peak is the last step's."""
    model = h200_check.build(name)
    track = LiveBytes()
    with FakeTensorMode():
        _on_fake_device(model)
        kind = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for-loop": dict(foreach=False)}[optimizer]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kind)
        x = torch.zeros(h200_check.BATCH, h200_check.SEQ, dtype=torch.long)
        with track:
            for t in list(model.parameters()) + list(model.buffers()):
                track.add(t.untyped_storage(), ("setup", "parameter or buffer", str(t.dtype).removeprefix("torch.")))
            for step in range(steps):
                if step == steps - 1:
                    track.reset_peak()
                track.phase = "forward"
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                    logits = out.logits if hasattr(out, "logits") else out
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x.reshape(-1))
                del out, logits
                track.phase = "backward"
                loss.backward()
                del loss
                track.phase = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
    return track


def render(track: LiveBytes, top: int = 12) -> str:
    lines = [f"peak {track.peak / GIB:.2f} GiB at {track.peak_op}",
             "per phase: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in track.phase_peak.items()),
             "alive at the peak, by (made in, operator, dtype):"]
    groups: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, what in track.at_peak.values():
        groups[what][0] += size
        groups[what][1] += 1
    for what, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / GIB:7.3f} GiB  {n:4d} tensors  {what[0]:9s} {what[1]} ({what[2]})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=("gpt", "llama"))
    ap.add_argument("--optimizer", choices=("foreach", "fused", "for-loop"), default="foreach")
    args = ap.parse_args(argv)
    print(render(replay(args.model, args.optimizer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
