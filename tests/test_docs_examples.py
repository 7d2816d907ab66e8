"""Every Python and shell example in README.md and docs/*.md runs (tests/docs_examples.py says how they
are found and marked), and the sample outputs in the docs are what the code prints now.

Each page's examples run in a fresh directory where ``examples/`` and ``benchmarks/`` are the repo's,
with this interpreter's ``python``, ``whalepy`` and ``torchrun`` first on PATH, HOME pointing into
the directory (``whalepy calibrate`` writes under ``~/.cache``) and one OpenMP thread per process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from docs_examples import ROOT, Block, mask, pages, parse, problems

BLOCKS = [b for p in pages() for b in parse(p)]
TIMEOUT_S = 600

RUNNER = r'''
import json, sys, traceback
ns = {"__name__": "__main__"}
for where, code in json.load(open(sys.argv[1])):
    try:
        exec(compile(code, where, "exec"), ns)
    except SystemExit as e:
        if e.code not in (None, 0):
            print(f"DOCS-EXAMPLE FAILED at {where}: exit {e.code}", file=sys.stderr)
            raise
    except BaseException:
        traceback.print_exc()
        print(f"DOCS-EXAMPLE FAILED at {where}", file=sys.stderr)
        sys.exit(1)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(workdir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's --master-port, for examples that name none
    env.pop("WHALEPY_PLAN", None)
    # one intra-op thread per example process, as torchrun gives each rank and tests/conftest.py this one:
    # on the 2-core CI machine under load, two OpenMP threads wait on each other at every kernel
    # (docs/profiling.md's examples: 63 s with two, 10 s with one); the examples print the same things
    env["OMP_NUM_THREADS"] = "1"
    # a crash (SIGABRT, SIGSEGV) prints every thread's Python stack: what the failure message shows
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def _run(cmd: list[str], workdir: Path, what: str) -> str:
    r = subprocess.run(cmd, cwd=workdir, env=_env(workdir), capture_output=True, text=True, timeout=TIMEOUT_S)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{what} failed (exit {r.returncode}):\n{out[-6000:]}"
    return r.stdout


def _python_blocks(blocks: list[Block], workdir: Path) -> Path:
    path = workdir / f"blocks_{blocks[0].line}.json"
    path.write_text(json.dumps([(b.where, b.runnable()) for b in blocks]))
    (workdir / "_docs_runner.py").write_text(RUNNER)
    return path


def test_every_block_is_run_or_marked() -> None:
    assert len(pages()) >= 5 and len(BLOCKS) > 20
    bad = [p for b in BLOCKS for p in problems(b)]
    assert not bad, "\n".join(bad)
    run = [b for b in BLOCKS if b.kind != "other" and b.skip is None]
    assert len(run) >= 0.7 * len([b for b in BLOCKS if b.kind != "other"]), "most examples must run"


RUN = defaultdict(list)
for _b in BLOCKS:
    if _b.kind != "other" and _b.skip is None:
        RUN[str(_b.path.relative_to(ROOT))].append(_b)
OUT = {b.where: b for b in BLOCKS if b.output_of is not None}


@pytest.mark.distributed
@pytest.mark.parametrize("page", sorted(RUN))
def test_page_examples(page: str, workdir: Path) -> None:
    """One page's examples in one directory: its Python blocks in one process (one namespace), then its
    torchrun blocks (one launch per process count), then its shell blocks, so later ones find the files
    earlier ones wrote (``plan.json``)."""
    blocks = RUN[page]
    py = [b for b in blocks if b.kind == "python" and b.torchrun is None]
    if py:
        _run([sys.executable, "_docs_runner.py", str(_python_blocks(py, workdir))], workdir, page)
    for n in sorted({b.torchrun for b in blocks if b.torchrun is not None}):
        group = [b for b in blocks if b.torchrun == n]
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
              "_docs_runner.py", str(_python_blocks(group, workdir))], workdir, f"{page} (torchrun x{n})")
    for b in blocks:
        if b.kind == "shell":
            _run(["bash", "-euo", "pipefail", "-c", b.runnable()], workdir, b.where)


@pytest.mark.parametrize("where", sorted(OUT))
def test_sample_outputs_are_what_the_code_prints(where: str, workdir: Path) -> None:
    b = OUT[where]
    out = _run(["bash", "-euo", "pipefail", "-c", b.output_of or ""], workdir, b.output_of or where)
    if os.environ.get("WHALEPY_DOCS_REGEN"):
        lines = b.path.read_text().splitlines(keepends=True)
        lines[b.line:b.end - 1] = [out if out.endswith("\n") else out + "\n"]
        b.path.write_text("".join(lines))
        return
    assert mask(out).rstrip("\n") == mask(b.code).rstrip("\n"), (
        f"{where} is not what `{b.output_of}` prints now; regenerate with "
        f"WHALEPY_DOCS_REGEN=1 pytest tests/test_docs_examples.py -k sample_outputs")
