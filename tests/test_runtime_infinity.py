"""The disk tier on 2 gloo ranks and its durability.

Every lowered (param_tier, optimizer_tier) pair with a file or host tier, under the ZeRO stages it
composes with, trains 3 AdamW steps and must match the single-process run (losses 1e-5 relative,
parameters 1e-5 absolute: fp32, the same arithmetic in another order), and hold on device, host and in
files exactly what :func:`estimate_model_state_bytes` predicts for the rank (within 1%; FSDP2 pads
shards and the staging slots and gradient files align tensors to 64 bytes): files at their peak in
the step and between steps (one generation), gradients of file-homed parameters in file mappings. All cases run in one launch (workers:
``infinity_cases.py``). Durability: a process killed in the middle of writing a step leaves the last
committed step loadable and no torn file.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from dist_harness import run_distributed
from durability_child import exit_without_close, state_checksum, tiny_blocks, tiny_model, train_forever
from infinity_cases import infinity_cases
from runtime_cases import Case
from whalepy.errors import WhalepyError
from whalepy.runtime._durable import TMP_SUFFIX, check_free_space
from whalepy.runtime.nvme import NvmeTier

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
HELD_RTOL = 0.01


def _tiers(p: str, o: str, **kw: object) -> dict:
    return {"param_tier": p, "optimizer_tier": o, **kw}


CASES = [
    Case("nvme/nvme zero3", dp=2, zero=3, extra=_tiers("nvme", "nvme", check_accumulation=True)),
    # 4 layers: 6 blocks, more than the 4 staging buffers of depth 2 (evictions)
    Case("nvme/nvme zero2 depth2 2mb", dp=2, zero=2, microbatches=2, num_layers=4,
         extra=_tiers("nvme", "nvme", prefetch_depth=2)),
    Case("nvme/nvme zero0 checkpoint", dp=2, zero=0, checkpoint=True, extra=_tiers("nvme", "nvme")),
    Case("nvme/cpu zero3", dp=2, zero=3, extra=_tiers("nvme", "cpu")),
    # clipping scales the file-mapped gradients in place (0.05: below the norms of all 3 steps)
    Case("nvme/nvme zero2 clipped", dp=2, zero=2, extra=_tiers("nvme", "nvme", max_grad_norm=0.05)),
    Case("gpu/nvme ddp", dp=2, zero=0, extra=_tiers("gpu", "nvme")),
    Case("cpu/nvme zero3", dp=2, zero=3, extra=_tiers("cpu", "nvme")),
    Case("cpu/cpu zero3 depth2", dp=2, zero=3, extra=_tiers("cpu", "cpu", prefetch_depth=2)),
    Case("nvme/nvme pp2", pp=2, microbatches=2, schedule="gpipe", extra=_tiers("nvme", "nvme")),
    # TP: norms, position embeddings and row-parallel biases whole on both TP ranks, the rest split
    Case("nvme/nvme tp2 zero3", tp=2, zero=3, extra=_tiers("nvme", "nvme")),
    ("restart", Case("nvme/nvme zero3", dp=2, zero=3, extra=_tiers("nvme", "nvme"))),
]


@pytest.mark.distributed
def test_disk_and_host_tiers_match_single_process_and_memory_model(tmp_path):
    per_rank = run_distributed(infinity_cases, 2, CASES, str(tmp_path), timeout=600)
    for rank, results in enumerate(per_rank):
        for r in results:
            assert r["loss_err"] <= LOSS_RTOL, (rank, r)
            assert r["param_err"] <= PARAM_ATOL, (rank, r)
            if r["name"].startswith("restart"):
                # commits: generation 0 at start (1), two steps (3), the restart's own start (4): it
                # resumed from the second step (a second model initialised at random matches only so)
                assert r["resumed_at"] == 4 and r["kept"], r
                continue
            for place, predicted in (r["predicted"] or {}).items():
                assert r["held"][place] == pytest.approx(predicted, rel=HELD_RTOL, abs=0), (rank, r)
            assert r["removed"], r  # close() removed the rank's directory
            if r["name"].startswith("nvme/"):
                assert r["kind"] == "fsdp2" and r["param_files"] > 0 and r["held"]["files"] > 0, r
                # every gradient of a file-homed parameter is in a shared file mapping, not anonymous memory
                total, mapped = r["grads_in_files"]
                assert total == mapped > 0, r
            if r["grad_norm"] is not None:  # clipping really engaged
                assert r["grad_norm"] > 0.05, r
            if "accumulated" in r:  # a second backward adds into the same mappings, in place
                acc = r["accumulated"]
                assert acc["in_place"] and acc["doubled"] and acc["files"][0] == acc["files"][1] > 0, r
    assert len(per_rank[0]) == len(CASES)


# -- durability ---------------------------------------------------------------------------------------


def test_a_crash_mid_write_resumes_from_the_last_committed_step(tmp_path):
    """SIGKILL a process while it writes a step's files (a temporary file is present): a new process on
    the directory finds the last committed step's states, whole, and no temporary file."""
    ctx = mp.get_context("spawn")
    directory = tmp_path / "tier"
    for _attempt in range(5):  # the kill must land inside a write; retried when it does not
        report = ctx.Queue()
        child = ctx.Process(target=train_forever, args=(str(directory), report))
        child.start()
        committed: dict[int, float] = {}
        torn = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not torn:
            while not report.empty():
                step, total = report.get()
                committed[step] = total
            if len(committed) >= 2 and any(directory.glob(f"*{TMP_SUFFIX}")):
                os.kill(child.pid, signal.SIGKILL)
                torn = any(directory.glob(f"*{TMP_SUFFIX}"))  # still there after the kill
        child.join()
        if not torn:
            child.kill()
            continue
        while not report.empty():
            step, total = report.get()
            committed[step] = total
        model, opt = tiny_model(seed=1)
        tier = NvmeTier(opt, Path(directory), keep=True)  # a restart: removes the torn temporaries
        tiny_blocks(tier, model)
        assert not any(directory.glob(f"*{TMP_SUFFIX}"))
        assert tier.resume()
        step = tier.engine.step_count
        # the manifest is the commit point: it names the last step whose files are all written, which
        # the child reported (or had just committed when it was killed, before reporting)
        assert step >= max(committed)
        if step in committed:
            assert state_checksum(opt) == committed[step]
        sizes = {f.name: f.stat().st_size for f in directory.glob("*.bin")}
        for b in tier.engine.blocks:
            for it in b.items:
                assert sizes[f"b{b.index:04d}.{it.name}.g{b.parity}.bin"] == it.nbytes
        # and training goes on from there; the restart's commit removes any newer, uncommitted
        # generation the killed process left: one generation at rest
        tier.install()
        tier.engine.drain()
        assert {f.name for f in directory.glob("*.bin")} == {
            f"b{b.index:04d}.{it.name}.g{b.parity}.bin" for b in tier.engine.blocks for it in b.items}
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()
        tier.close()
        return
    pytest.fail("the kill never landed inside a write in 5 attempts")


def test_files_are_removed_at_interpreter_exit_unless_kept(tmp_path):
    removed, kept = tmp_path / "removed", tmp_path / "kept"
    child = mp.get_context("spawn").Process(target=exit_without_close, args=(str(removed), str(kept)))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert not removed.exists()
    # 2 blocks x (weight, bias) x (exp_avg, exp_avg_sq), one generation after one step
    assert (kept / "manifest.json").exists() and len(list(kept.glob("*.bin"))) == 2 * 2 * 2


def test_a_full_disk_is_a_clear_error_before_training(tmp_path):
    """The free space check ``build_nvme_tier`` runs before writing anything (an unwritable directory:
    test_runtime_nvme.py)."""
    with pytest.raises(WhalepyError, match=r"GiB free but this rank's disk tier needs .* larger drive"):
        check_free_space(tmp_path, 1e18, user_dir=tmp_path)
    check_free_space(tmp_path, 1.0)
    # the tier checks before it writes a byte: 1 MiB free for the peak (two generations, while a step
    # writes) of the first layer's AdamW states (525312 parameters x 8 bytes x 2 = 8.0 MiB)
    import shutil
    from collections import namedtuple

    from whalepy.ir.plan import BlockPlan
    from whalepy.runtime.nvme import build_nvme_tier

    model, opt = tiny_model()
    usage = namedtuple("usage", "total used free")
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(shutil, "disk_usage", lambda _path: usage(2**40, 2**40 - 2**20, 2**20))
        with pytest.raises(WhalepyError, match=r"has 0.00 GiB free but this rank's disk tier needs 0.01 GiB"):
            build_nvme_tier(opt, [(BlockPlan(name="l0", optimizer_tier="nvme"), model, [model[0]])], rank=0,
                            nvme_dir=tmp_path / "small")
    assert not list((tmp_path / "small").rglob("*.bin"))
