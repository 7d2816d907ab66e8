"""``whalepy <command> --help`` is quick and complete: it imports neither torch nor the planner (the
issue measured ``calibrate --help`` at 9.5-17 s while it imported torch), and every flag and positional
argument of every subcommand has a help text. Times of each are in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from whalepy.tools.cli import COMMANDS, build_parser


def _actions(parser: argparse.ArgumentParser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _actions(sub)
        elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
            yield parser.prog, a


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help(command):
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    missing = [f"{prog}: {'/'.join(a.option_strings) or a.dest}" for prog, a in _actions(sub) if not a.help]
    assert missing == []


def test_help_imports_no_torch():
    code = ("import sys, json\nfrom whalepy.tools.cli import COMMANDS, main\nout = {}\n"
            "for c in COMMANDS:\n"
            "    try:\n        main([c, '--help'])\n    except SystemExit:\n        pass\n"
            "    out[c] = sorted(m for m in ('torch', 'pulp', 'highspy') if m in sys.modules)\n"
            "print(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert loaded == {c: [] for c in COMMANDS}, loaded
