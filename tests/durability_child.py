"""The child process of the crash test (test_runtime_infinity.py): kept free of the test suite's heavy
imports so that it starts quickly under ``spawn``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from whalepy.runtime.nvme import NvmeTier, prepare_nvme_dir


def tiny_model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # ~1M parameters: 8 MiB of states
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def tiny_blocks(tier: NvmeTier, model: nn.Module) -> None:
    for i, layer in enumerate(model):
        tier.add_block(f"l{i}", layer.parameters(), write=False)


def state_checksum(opt: torch.optim.Optimizer) -> float:
    return sum(float(v.double().sum()) for s in opt.state.values() for v in s.values() if v.dim())


def train_forever(directory: str, report: Any) -> None:
    """Train with the optimizer states in files under ``directory`` (kept), reporting each committed
    step's number and state checksum, until killed."""
    torch.set_num_threads(1)
    model, opt = tiny_model()
    tier = NvmeTier(opt, prepare_nvme_dir(Path(directory), keep=True), keep=True)
    tiny_blocks(tier, model)
    tier.install()
    g = torch.Generator().manual_seed(0)
    while True:
        model(torch.randn(8, 512, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tier.engine.flush()  # this step's manifest is committed: report what it holds
        report.put((tier.engine.step_count, state_checksum(opt)))


def exit_without_close(removed: str, kept: str) -> None:
    """Train one step in two tiers, one with ``keep``, and return without closing either: the
    interpreter's exit must remove the first directory and leave the second."""
    for directory, keep in ((removed, False), (kept, True)):
        model, opt = tiny_model()
        tier = NvmeTier(opt, prepare_nvme_dir(Path(directory), keep=keep), keep=keep)
        tiny_blocks(tier, model)
        tier.install()
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()
