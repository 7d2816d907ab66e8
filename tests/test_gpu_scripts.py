"""The GPU scripts (benchmarks/gpu_session.sh, gpu_check.sh) run only where a GPU is lent, so what can be
checked without one is checked here: every module they run with ``python -m`` imports under that name,
and every script or test file they name exists. (A GPU call lost its `calibrate` part to a module path
left behind by a file move: ``python -m whalepy.cli``.)"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "benchmarks" / "gpu_session.sh", ROOT / "benchmarks" / "gpu_check.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_modules_and_files_the_script_runs_exist(script):
    text = script.read_text()
    modules = set(re.findall(r"-m\s+(whalepy[\w.]*)", text))
    files = set(re.findall(r"\b((?:benchmarks|tests)/[\w./-]+\.(?:py|sh))\b", text))
    assert modules or files, f"{script.name} names no module or file: the patterns above are stale"
    for mod in sorted(modules):
        spec = importlib.util.find_spec(mod)
        assert spec is not None, f"{script.name} runs `python -m {mod}`, which does not exist"
        if spec.submodule_search_locations is None:  # a module run with -m must have a main guard
            assert "__main__" in Path(spec.origin).read_text(), f"{mod} has no `if __name__ == '__main__'`"
    for f in sorted(files):
        assert (ROOT / f).exists(), f"{script.name} names {f}, which does not exist"


def test_gpu_check_runs_every_part_of_the_session():
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    parts = re.search(r"^exec bash benchmarks/gpu_session\.sh ([\w ]+)$", text, re.M).group(1).split()
    session = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    for part in parts:
        assert re.search(rf"^\s+{part}\)", session, re.M), f"gpu_check.sh runs part {part!r}, unknown to gpu_session.sh"
    assert {"tiers", "step", "offload", "offload_large", "calibrate"} <= set(parts)
