"""Measured planning beside busy peers (``whalepy.profile(..., measure=True, cpu_peers=n)``): the blocks
of a CPU rank are timed while ``n`` other processes run the model, as the node's other ranks do in the
job. What is checked here is the mechanism (the peers run during the measurement, the table says so,
they are gone afterwards, a model that cannot reach them is one clear error); how much the peers slow
the blocks is measured in ``benchmarks/bench_predict_cpu.py`` (docs/benchmarks.md), not in a test."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
from torch import nn

import whalepy
from whalepy import WhalepyError
from whalepy.frontend.measure import cpu_peers_running

from bad_input_cases import TOKENS, tiny


def _peer_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_peers_compute_while_inside_and_are_gone_after() -> None:
    model = tiny()
    with cpu_peers_running(model, (TOKENS,), 1):
        (peer,) = multiprocessing.active_children()
        before = _peer_cpu_seconds(peer.pid)
        time.sleep(0.5)
        busy = _peer_cpu_seconds(peer.pid) - before
        assert peer.is_alive()
    assert busy > 0.2, f"the peer used {busy:.2f} s of CPU in 0.5 s: it is not running the model"
    assert not peer.is_alive() and not multiprocessing.active_children()


def test_measured_profile_beside_a_peer() -> None:
    prof = whalepy.profile(tiny(), (TOKENS,), measure=True, lowered=False, repeats=1, device="cpu", cpu_peers=1)
    m = prof.measured
    assert "beside 1 busy peer" in m.source
    assert m.times and all(f > 0 and b > 0 for rows in m.times.values() for f, b in rows.values())
    assert not multiprocessing.active_children()
    # the same model measured without peers has the same table keys: only the conditions differ
    alone = whalepy.profile(tiny(), (TOKENS,), measure=True, lowered=False, repeats=1, device="cpu")
    assert alone.measured.times.keys() == m.times.keys() and "peer" not in alone.measured.source


class _Unpicklable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny()
        self.hook = lambda x: x  # a lambda attribute: the model cannot be pickled to a spawned process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook(self.inner(x))


def test_a_model_that_cannot_reach_the_peers_is_one_error() -> None:
    with pytest.raises(WhalepyError, match=r"cpu_peers=1 runs the model in 1 other process.*give cpu_peers=0"):
        with cpu_peers_running(_Unpicklable(), (TOKENS,), 1):
            pass
    assert not multiprocessing.active_children()


def test_a_peer_whose_step_fails_says_why() -> None:
    wrong = (torch.zeros(2, 3),)  # floats where the model embeds token ids: the peer's forward raises
    with pytest.raises(WhalepyError, match=r"cpu_peers=1 failed to run the model \(RuntimeError: .*give cpu_peers=0"):
        with cpu_peers_running(tiny(), wrong, 1):
            pass
    assert not multiprocessing.active_children()


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path) -> None:
    """The peers start with ``spawn``, which imports the launching script again: without
    ``if __name__ == "__main__":`` its peer dies before the model runs, and the error says so."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    script = tmp_path / "measure_script.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(tests)!r})\nimport whalepy\n"
                      "from bad_input_cases import TOKENS, tiny\n"
                      "whalepy.profile(tiny(), (TOKENS,), measure=True, lowered=False, repeats=1, device='cpu', "
                      "cpu_peers=1)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "WhalepyError" in last and 'if __name__ == "__main__":' in last and "cpu_peers=0" in last, last


def test_cpu_measures_the_whole_model_unless_told_to_truncate(monkeypatch) -> None:
    """On the CPU a run of identical blocks is timed whole by default (a block's time depends on the cache
    its neighbours leave: ``measure.TRUNCATE_ON_CPU``), truncated where asked; its members' times are
    averaged into the signature's row."""
    import contextlib

    from whalepy.frontend import measure

    seen: list[bool] = []
    real = measure._maybe_truncated

    @contextlib.contextmanager
    def spy(model, truncate):  # type: ignore[no-untyped-def]
        seen.append(truncate)
        with real(model, truncate):
            yield

    monkeypatch.setattr(measure, "_maybe_truncated", spy)
    for kw, want in (({}, False), ({"truncate": True}, True)):
        prof = whalepy.profile(tiny(), (TOKENS,), measure=True, lowered=False, repeats=1, device="cpu", **kw)
        assert seen[-1] is want and prof.measured.times


def test_members_of_one_signature_are_averaged() -> None:
    from whalepy.frontend.measure import _MeanRow

    row = _MeanRow()
    row["fb"] = (1.0, 3.0)
    row["fb"] = (3.0, 5.0)
    row["fb"] = (5.0, 7.0)
    row["bytes"] = 10.0
    row["bytes"] = 20.0
    assert dict(row) == {"fb": (3.0, 5.0), "bytes": 15.0}
