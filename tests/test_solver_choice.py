"""Which MIP solver runs, under pulp 3 (CBC bundled) and pulp 4 (CBC only through ``pulp[cbc]`` or a
``cbc`` on PATH): HiGHS by default, CBC when asked and provided, else a one-line PlanError."""

from __future__ import annotations

import pulp
import pytest

from whalepy.errors import PlanError
from whalepy.planner import _solvers, ilp, plan_from_profile
from whalepy.planner.synthetic import transformer_profile

from planner_fixtures import a100


def _plan(solver: str):  # type: ignore[no-untyped-def]
    prof = transformer_profile(num_layers=4, hidden=1024, seq_len=512, vocab=8000, num_heads=8, batch=1,
                               name="solver-choice")
    return plan_from_profile(prof, a100(1, per_node=4), global_batch=8, solver=solver, max_microbatches=4)


def test_cbc_finds_what_highs_finds_or_says_how_to_get_it():
    highs = _plan("highs")
    assert highs.solver.solver == "highs" and not any("CBC" in n for n in highs.notes)
    if _solvers._cbc(msg=False).available():
        cbc = _plan("cbc")
        assert cbc.solver.solver == "cbc"
        # both stop at the relative MIP gap MIP_REL_GAP of the same objective
        assert cbc.cost.step_time_s == pytest.approx(highs.cost.step_time_s, rel=2 * ilp.MIP_REL_GAP)
    else:
        with pytest.raises(PlanError, match=r"solver='cbc'.*pulp\[cbc\]"):
            _plan("cbc")


class _Unavailable:
    def __init__(self, **_kwargs):  # type: ignore[no-untyped-def]
        pass

    def available(self) -> bool:
        return False


def test_fallback_note_and_no_solver_message(monkeypatch):
    monkeypatch.setattr(pulp.HiGHS, "available", lambda self: False)
    if _solvers._cbc(msg=False).available():
        solver, notes = ilp.choose_solver("highs")
        assert solver == "cbc" and "HiGHS (highspy) is not available" in notes[0]
    monkeypatch.setattr(_solvers, "_cbc", _Unavailable)
    with pytest.raises(PlanError, match="no MIP solver.*pip install highspy") as e:
        _plan("highs")  # raised before any candidate is built
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match=r"solver='cbc'.*pip install highspy"):
        ilp.choose_solver("cbc")


def test_importing_the_planner_keeps_no_caller_alive():
    """PuLP keeps each solver it failed to load as an exception with its traceback; that traceback held
    (through ``f_back``) the frame whose import first loaded PuLP, so the first ``parallelize`` of a
    process kept its model, on the GPU, alive after the ParallelModel was gone (5.28 GiB in every later
    peak of the H200 run). A fresh interpreter: the import happens inside a function."""
    import subprocess
    import sys

    code = ("import gc, weakref\nclass Held: pass\n"
            "def first_plan():\n    held = Held()\n    import whalepy.planner\n    return weakref.ref(held)\n"
            "ref = first_plan()\ngc.collect()\nprint('ALIVE' if ref() is not None else 'FREED')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("FREED"), r.stdout[-400:]
