"""Wall time of ``whalepy <command> --help`` for every subcommand (a fresh interpreter each, best of
``--repeat``), as a Markdown table for docs/benchmarks.md.

    python benchmarks/bench_cli_help.py --repeat 5
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs per command; the best is shown")
    args = ap.parse_args()
    from whalepy.tools.cli import COMMANDS

    commands = [[]] + [[c] if c != "study" else ["study", "zero"] for c in COMMANDS]
    print(f"load before: {open('/proc/loadavg').read().split()[:3]}" if os.path.exists("/proc/loadavg") else "")
    print("| command | wall s, best | wall s, median | CPU s (user + sys), median |")
    print("|---|---|---|---|")
    for cmd in commands:
        times, cpu = [], []
        for _ in range(args.repeat):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "whalepy.tools.cli", *cmd, "--help"], check=True,
                           stdout=subprocess.DEVNULL)
            times.append(time.perf_counter() - t)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        times.sort()
        cpu.sort()
        print(f"| `whalepy {' '.join(cmd + ['--help'])}` | {times[0]:.2f} | {times[len(times) // 2]:.2f} "
              f"| {cpu[len(cpu) // 2]:.2f} |")


if __name__ == "__main__":
    main()
