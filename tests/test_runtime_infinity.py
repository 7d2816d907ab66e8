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

import json
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
from whalepy.errors import ArgumentError, DiskSpaceError
from whalepy.runtime._durable import TMP_SUFFIX
from whalepy.runtime.disk_space import check_disk_tier_space
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
    ("disk full", Case("nvme/nvme zero3", dp=2, zero=3, extra=_tiers("nvme", "nvme"))),
]


@pytest.mark.distributed
def test_disk_and_host_tiers_match_single_process_and_memory_model(tmp_path):
    per_rank = run_distributed(infinity_cases, 2, CASES, str(tmp_path), timeout=600)
    for rank, results in enumerate(per_rank):
        for r in results:
            if r["name"] == "disk full":
                _assert_refused_on_every_rank(per_rank, rank, r)
                continue
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


def _assert_refused_on_every_rank(per_rank: list, rank: int, r: dict) -> None:
    """The ranks' disk tiers, each within the file system's budget alone, together beyond it: the same
    one-line error on every rank, naming both ranks and their summed bytes, and no file written."""
    import re

    assert r["error"] is not None, r  # refused, not trained
    assert r["error"] == next(x for x in per_rank[0] if x["name"] == "disk full")["error"]
    assert "ranks 0-1 (one file system)" in r["error"] and "WHALEPY_NVME_BUDGET_BYTES allows" in r["error"], r
    assert "run fewer ranks per node" in r["error"] and "\n" not in r["error"], r
    need, unit = re.search(r"need ([0-9.]+) (KiB|MiB) at their peak", r["error"]).groups()
    # the tier's own bytes (FSDP2's shard sizes), summed over the 2 ranks: the memory model's within 1%
    assert float(need) * {"KiB": 2**10, "MiB": 2**20}[unit] == pytest.approx(2 * r["one_rank"], rel=HELD_RTOL)
    assert r["left"] == [], r  # nothing created under nvme_dir


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


def test_files_are_removed_when_a_whalepy_error_ends_the_launch(tmp_path):
    """Under a launch an uncaught whalepy error ends the process with ``os._exit`` (launch_errors.py),
    which skips atexit handlers: the disk tier's directory must go all the same; a kept one stays."""
    import subprocess
    import sys

    removed, kept = tmp_path / "removed", tmp_path / "kept"
    code = ("import whalepy\n"
            "from pathlib import Path\n"
            "from whalepy.runtime.nvme import prepare_nvme_dir\n"
            f"prepare_nvme_dir(Path({str(removed)!r}))\n"
            f"prepare_nvme_dir(Path({str(kept)!r}), keep=True)\n"
            "raise whalepy.ArgumentError('a bad batch')\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "whalepy: error (rank 0): a bad batch" in out.stderr, out.stderr
    assert not removed.exists() and kept.is_dir()


def test_a_full_disk_is_a_clear_error_before_training(tmp_path, monkeypatch):
    """The tier checks before it creates or writes anything: here a budget of 1 MiB on the file system
    (``WHALEPY_NVME_BUDGET_BYTES``) for the peak (two generations, while a step writes) of the first
    layer's AdamW states (525312 parameters x 8 bytes x 2 = 8.0 MiB). The gloo case of the summed check:
    "disk full" above; the grouping by file system: test_disk_shares_are_summed_per_file_system."""
    from whalepy.ir.plan import BlockPlan
    from whalepy.runtime.disk_space import BUDGET_ENV
    from whalepy.runtime.nvme import build_nvme_tier

    model, opt = tiny_model()
    monkeypatch.setenv(BUDGET_ENV, str(2**20))
    with pytest.raises(DiskSpaceError, match=r"files of rank 0 \(one file system\) need 8.02 MiB at their peak .*"
                                             r"WHALEPY_NVME_BUDGET_BYTES allows 1.00 MiB there"):
        build_nvme_tier(opt, [(BlockPlan(name="l0", optimizer_tier="nvme"), model, [model[0]])], rank=0,
                        nvme_dir=tmp_path / "small")
    assert not (tmp_path / "small").exists()
    monkeypatch.setenv(BUDGET_ENV, "10GB")
    with pytest.raises(ArgumentError, match=r"WHALEPY_NVME_BUDGET_BYTES='10GB': give the most bytes"):
        check_disk_tier_space(tmp_path, 1.0)
    monkeypatch.delenv(BUDGET_ENV)
    check_disk_tier_space(tmp_path, 1.0)


def test_disk_shares_are_summed_per_file_system():
    """Ranks on one host and device share its free space (summed); another host's drive, with the same
    device number, is another file system; a rank without a disk tier counts for nothing."""
    from whalepy.runtime.disk_space import DiskShare, shortfall

    def share(rank: int, host: str, needed: float, budget: float | None = None) -> DiskShare:
        return DiskShare(rank=rank, host=host, device=7, path="/nvme", needed=needed, free=100 * 2**20,
                         reserve=2**20, budget=budget)

    assert shortfall([share(0, "a", 40 * 2**20), share(1, "a", 40 * 2**20), share(2, "b", 90 * 2**20),
                      share(3, "a", 0.0)]) is None  # 80 of 99 MiB on a, 90 of 99 on b
    msg = shortfall([share(r, "a", 40 * 2**20) for r in range(3)] + [share(3, "b", 40 * 2**20)])
    assert msg.startswith("nvme_dir '/nvme' on host 'a': the disk tier's files of ranks 0-2 (one file system) "
                          "need 120.00 MiB at their peak while a step writes (40.00 MiB each), but it has "
                          "100.00 MiB free, less a reserve of 1.00 MiB (1% of the file system). To fit:"), msg
    assert "host 'b'" not in msg and "other file system" not in msg
    # a budget on one rank of the file system binds them all
    msg = shortfall([share(0, "a", 30 * 2**20), share(1, "a", 30 * 2**20, budget=50 * 2**20)])
    assert "WHALEPY_NVME_BUDGET_BYTES allows 50.00 MiB there (100.00 MiB free). To fit: raise" in msg, msg


@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept"])
def test_a_disk_filled_during_a_step_is_a_clear_error_and_the_files_go(tmp_path, keep):
    """Another process fills the file system after the check: the write of the next generation's first
    file fails with a real ENOSPC (its temporary name is a link to /dev/full, which the kernel answers
    so). The step's error is a DiskSpaceError naming the file, not a raw OSError; the tier's directory is
    removed on the way out (``keep``: only the temporary files, and the manifest still names the last
    committed step, whose files are all there: the failed step's manifest never ran), and close()
    afterwards is quiet."""
    import errno

    from whalepy.runtime.nvme import prepare_nvme_dir

    if not os.path.exists("/dev/full"):
        pytest.fail("/dev/full is missing: this test needs the kernel's always-full device")
    model, opt = tiny_model()
    tier = NvmeTier(opt, prepare_nvme_dir(tmp_path / "t", keep=keep), fsync=False, keep=keep)
    for i, layer in enumerate(model):
        tier.add_block(f"l{i}", layer.parameters())
    tier.install()
    x = torch.randn(8, 512)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tier.engine.flush()

    step()  # the states now live in generation-1 files; the next step writes generation 0
    target = tier.directory / "b0000.s0.exp_avg.g0.bin"
    (tier.directory / (target.name + TMP_SUFFIX)).symlink_to("/dev/full")
    with pytest.raises(DiskSpaceError, match=rf"could not write '{target}' \(2.00 MiB\): No space left on device"
                                             r".* tier's files are removed") as got:
        step()
    assert got.value.errno == errno.ENOSPC and isinstance(got.value, OSError)
    assert tier.engine.aborted and tier.directory.exists() == keep
    if keep:
        manifest = json.loads((tier.directory / "manifest.json").read_text())
        assert manifest["step"] == 2 and not list(tier.directory.glob(f"*{TMP_SUFFIX}"))  # generation 0, step 1
        for b, block in enumerate(manifest["blocks"]):
            for name in block["items"]:
                assert (tier.directory / f"b{b:04d}.{name}.g{block['parity']}.bin").exists()
    with pytest.raises(DiskSpaceError, match="stopped when its file system was full"):
        step()  # training on after the error: said so, not the I/O thread's "cannot schedule" RuntimeError
    tier.close()  # nothing left to finish
