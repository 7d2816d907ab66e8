"""``whalepy run``'s launcher process: ``torch.distributed.run`` with its failure report cut to one line.

Run as ``python -m whalepy.tools.torchrun <torchrun arguments>``. When a rank fails, torchrun itself logs each
failed rank and raises ``ChildFailedError``, whose traceback and report box add about 40 lines after the
rank's own message (with whalepy's excepthook, one ``whalepy: error (rank R): ...`` line). Here the elastic
agent's loggers are quieted to CRITICAL (and torchrun's OMP_NUM_THREADS banner to ERROR) and the failure becomes one line naming the failed ranks and their
exit codes (or signals: a rank killed for memory shows ``SIGKILL``); the exit code stays non-zero. A
plain ``torchrun`` launch keeps torchrun's own report.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)  # the OMP_NUM_THREADS banner
    try:
        run(args)
    except ChildFailedError as e:
        def why(f) -> str:  # type: ignore[no-untyped-def]
            return f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"

        failed = ", ".join(f"rank {rank} ({why(f)})" for rank, f in sorted(e.failures.items()))
        print(f"whalepy run: {e.name} failed on {failed}; the error is printed above", file=sys.stderr)
        first = next(iter(e.failures.values()))
        return first.exitcode if first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
