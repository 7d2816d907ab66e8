"""Checkpoints survive a crash (issue 25): 4-process gloo jobs killed (SIGKILL, one rank or all) at
points inside ``pm.save``, into a new directory and over the previous checkpoint's, then resumed.
Each resumed job must load the last complete checkpoint (an incomplete one is refused, naming it) and
its losses must equal the uninterrupted run's, exactly; a checkpoint with a corrupted data file is
refused. The jobs are chained, each resuming from what the previous crash left, so that four process
starts test four kills (tests/checkpoint_fault_cases.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoint_fault_cases import reference_then_crash, resume_then_crash, setup
from dist_harness import DistributedTestError, run_distributed
from whalepy import WhalepyError
from whalepy.runtime.commit import MANIFEST, resolve, verify

PRELOAD = ("checkpoint_fault_cases", "whalepy.runtime")  # one import for the 16 processes of 4 jobs
KILLED = r"exited with code -9|Connection|closed|reset"
# (load, refused naming, step the loaded state is at, save target, kill point); see _commit.KILL_POINTS
CHAIN = [
    ("s8", "same", 2, "same", "hashed"),     # refused; over the old one, every rank killed before the manifest
    ("same", None, 2, "same", "aside@0"),    # rank 0 killed between the two renames of the commit
    ("same", None, 4, "same", "swapped@0"),  # the new one (kept aside) loads; corruption is refused; killed
]                                            # after the new one is in place, before the old is removed


def test_killed_saves_resume_the_last_complete_checkpoint(tmp_path: Path) -> None:
    root, made = str(tmp_path), setup()
    # uninterrupted: 8 steps, "same" saved at step 2; then a save into a new directory, one rank killed
    # after DCP wrote its files
    with pytest.raises(DistributedTestError, match=KILLED):
        run_distributed(reference_then_crash, 4, made, root, "s8", "written@1", preload=PRELOAD)
    straight = json.loads((tmp_path / "straight.json").read_text())
    for load, fallback, step, target, kill in CHAIN:
        with pytest.raises(DistributedTestError, match=KILLED):
            run_distributed(resume_then_crash, 4, made, root, load, fallback, step, target, kill,
                            kill == "swapped@0", preload=PRELOAD)
        got = json.loads((tmp_path / f"losses-{step}-{fallback or load}-{kill}.json").read_text())
        assert got == straight[step:step + 2], (kill, got, straight)
    # the last crash: the new checkpoint (step 6) is in place and whole, the old one still aside
    assert resolve(tmp_path / "same") == tmp_path / "same"
    verify(tmp_path / "same", distributed=False)
    new = json.loads((tmp_path / "same" / MANIFEST).read_text())["committed"]
    assert new > json.loads((tmp_path / ".same.whalepy-previous" / MANIFEST).read_text())["committed"]
    # the first crash left "s8" incomplete: refused, naming "same"
    with pytest.raises(WhalepyError, match=r"s8 is not a complete checkpoint .* is .*same"):
        resolve(tmp_path / "s8")
    assert not (tmp_path / "s8").exists() and (tmp_path / ".s8.whalepy-partial").is_dir()
