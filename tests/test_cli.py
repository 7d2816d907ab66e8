"""The whalepy console script: plan / show / estimate, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from whalepy.tools.cli import main

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    path = CLUSTERS / "h100_8x8.yaml"
    if path.exists():
        return str(path)
    p = tmp_path_factory.mktemp("c") / "c.json"  # examples not there yet: an equivalent spec
    p.write_text(json.dumps({"network": {"bandwidth_gbps": 3200}, "groups": [
        {"name": "h100", "gpu": "H100-SXM", "gpus_per_node": 8, "nodes": 8, "intra_node": "nvswitch",
         "cpu_memory_gb": 2048}]}))
    return str(p)


def test_plan_show_estimate_synthetic(cluster_file, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "plan.json"
    assert main(["plan", "synthetic:llama3-8b", "--cluster", cluster_file, "--global-batch", "16",
                 "--out", str(out), "--explain"]) == 0
    captured = capsys.readouterr()
    assert "step time" in captured.out and "Chosen:" in captured.out
    assert "enumerating candidates" in captured.err  # progress on stderr
    assert out.exists()
    assert main(["show", str(out)]) == 0
    assert "llama3-8b" in capsys.readouterr().out
    assert main(["estimate", "synthetic:llama3-8b", "--cluster", cluster_file, "--global-batch", "16",
                 "--dp", "8", "--tp", "8", "--microbatches", "2", "--zero", "1", "--checkpoint", "-q"]) == 0
    assert "Estimate dp=8 tp=8" in capsys.readouterr().out


def test_plan_builtin_gpt2_with_capture(cluster_file, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "gpt2.json"
    assert main(["plan", "gpt2", "--cluster", cluster_file, "--global-batch", "64", "--seq-len", "128",
                 "--no-cache", "--out", str(out)]) == 0
    text = capsys.readouterr()
    assert "captured" in text.err and "samples/s" in text.out
    assert text.out.startswith("Plan for gpt2 on ")  # the built-in's name, not its class's


CONSOLE_SCRIPT = [sys.executable, "-m", "whalepy.tools.cli"]
"""What the ``whalepy`` script runs (``tools.cli:entry``): ``main`` in a process of its own, which it ends
without the interpreter's teardown."""


def _whalepy(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([*CONSOLE_SCRIPT, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300)


def test_help_and_version_import_neither_torch_nor_the_planner() -> None:
    code = ("import sys; from whalepy.tools.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'pulp', "
            "'highspy', 'networkx') or m.startswith('whalepy.planner'))\nprint('HEAVY', heavy)")
    for args in (["--help"], ["--version"], ["plan", "--help"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "HEAVY []" in r.stdout, (args, r.stdout[-400:])
    from whalepy import __version__

    assert _whalepy("--version").stdout.strip() == f"whalepy {__version__}"


def test_output_into_a_closed_pipe_ends_quietly(cluster_file) -> None:  # type: ignore[no-untyped-def]
    """``whalepy plan ... | head -1``: the reader goes away. Here it closes the pipe before the first
    write, so the write fails every time (with ``head`` that depends on timing and output size)."""
    cmd = [*CONSOLE_SCRIPT, "plan", "synthetic:gpt2", "--cluster", cluster_file, "--global-batch", "16", "--explain",
           "-q"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err  # 128 + SIGPIPE, as a shell reports it
    assert err == "", err  # no BrokenPipeError traceback, nor "Exception ignored ... flush"


def test_console_script_prints_all_and_runs_atexit_handlers(cluster_file, capsys) -> None:  # type: ignore[no-untyped-def]
    """The script ends with ``os._exit`` (no interpreter teardown): its output into a pipe is whole (the
    same as ``main``'s in this process, but for the measured solve time), its exit code is main's, and
    the ``atexit`` handlers (logging's flush, a user's) still run."""
    args = ["plan", "synthetic:gpt2", "--cluster", cluster_file, "--global-batch", "16", "--explain", "-q"]
    code = ("import atexit, sys; atexit.register(lambda: print('atexit ran', file=sys.stderr)); "
            "from whalepy.tools.cli import entry; entry()")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "atexit ran\n", r.stderr
    assert main(args) == 0
    here = capsys.readouterr().out

    def timeless(text: str) -> list[str]:
        return [line for line in text.splitlines() if "solve time" not in line]

    assert "step time" in here and timeless(r.stdout) == timeless(here)


def test_user_errors_are_one_line_with_exit_code_2(cluster_file, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", "no-such-model", "--cluster", cluster_file]) == 2
    err = capsys.readouterr().err
    assert "built-in models are" in err and "Traceback" not in err
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert "no plan file" in capsys.readouterr().err
    assert main(["estimate", "gpt2", "--cluster", cluster_file, "--dp", "3"]) == 2
    err = capsys.readouterr().err
    assert "world size" in err and "captur" not in err  # refused before the model is captured


def test_run_subcommand_is_registered_when_launch_exists() -> None:
    from whalepy.tools.cli import build_parser

    parser = build_parser()
    assert "run" in parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]


def test_optimizer_impl_and_compile_flags_reach_the_plan(cluster_file, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--optimizer-impl`` / ``--compile`` set the plan's choices (``auto`` on this GPU cluster: fused and
    compiled), and the plan's text and the estimate say them on one line."""
    from whalepy.ir.plan import Plan

    out = tmp_path / "plan.json"
    common = ["synthetic:llama3-8b", "--cluster", cluster_file, "--global-batch", "16", "-q"]
    assert main(["plan", *common, "--optimizer-impl", "as_given", "--compile", "off", "--out", str(out)]) == 0
    plan = Plan.load(str(out))
    assert (plan.optimizer_impl.value, plan.compile) == ("as_given", False)
    assert "optimizer: as given (the factory's optimizer exactly); compiled blocks: no" in capsys.readouterr().out
    assert main(["estimate", *common, "--dp", "8", "--tp", "8", "--microbatches", "2", "--zero", "1",
                 "--checkpoint"]) == 0
    assert "optimizer: fused (torch's fused kernel of the user's optimizer class); compiled blocks: yes" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["estimate", *common, "--dp", "8", "--compile", "maybe"])
    assert e.value.code == 2 and "--compile" in capsys.readouterr().err
