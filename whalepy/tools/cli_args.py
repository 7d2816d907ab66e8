"""Checks of the ``whalepy`` command line's values, run before anything is loaded or captured.

argparse checks types; these check ranges and combinations (``--seq-len 0``, ``--zero-stages a,b``,
``--dp 0``, ``--schedules gpipe,foo``) and say the flag, the value and what to write instead, as one
``[whalepy] error: ...`` line (exit code 2), like every other whalepy error.
"""

from __future__ import annotations

import argparse
import os

from whalepy.errors import ArgumentError

__all__ = ["check_cli_args", "one_line_usage_errors"]

_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _positive(args: argparse.Namespace, dest: str, *, allow_none: bool = True, kind: str = "integer") -> None:
    value = getattr(args, dest, None)
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ArgumentError(f"{_flag(dest)} {value}: must be a positive {kind}; e.g. {_flag(dest)} "
                            f"{'8' if kind == 'integer' else '60'}")


def _comma_list(args: argparse.Namespace, dest: str, allowed: tuple[str, ...]) -> None:
    value = getattr(args, dest, None)
    if value is None:
        return
    items = [x.strip() for x in value.split(",")]
    bad = [x for x in items if x not in allowed]
    if not items or bad:
        raise ArgumentError(f"{_flag(dest)} {value}: {', '.join(repr(b) for b in bad) or 'empty'} is not one of "
                            f"{', '.join(allowed)}; give a comma-separated list, e.g. {_flag(dest)} "
                            f"{','.join(allowed[:2])}")


def _output_paths(args: argparse.Namespace) -> None:
    """Files a command writes at its end (``--out``, ``--html``, ...): their directory must exist, so a
    plan is not searched for minutes and then lost to a traceback."""
    import os

    for dest in ("out", "html", "svg", "csv", "plot"):
        value = getattr(args, dest, None)
        if dest == "out" and getattr(args, "command", None) == "calibrate":
            continue  # a file or a directory there (whalepy.tools.calibrate checks it)
        if not isinstance(value, str) or not value:
            continue
        parent = os.path.dirname(os.path.abspath(value))
        if os.path.isdir(value):
            raise ArgumentError(f"{_flag(dest)} {value}: is a directory; give a file name, e.g. "
                                f"{_flag(dest)} {os.path.join(value, 'plan.json' if dest == 'out' else 'out.' + dest)}")
        if not os.path.isdir(parent):
            raise ArgumentError(f"{_flag(dest)} {value}: cannot write there, the directory {parent} does not "
                                "exist; create it (mkdir -p) or write the file elsewhere")
        if not os.access(parent, os.W_OK):
            raise ArgumentError(f"{_flag(dest)} {value}: cannot write there, the directory {parent} is not "
                                "writable; write the file elsewhere")
        _not_an_input(args, dest, value)


_INPUTS = ("plan", "first", "second", "checkpoint", "config", "cluster", "from_microbench", "memory_trace", "model")


def _not_an_input(args: argparse.Namespace, dest: str, value: str) -> None:
    """An output path equal to one of the same command's input files (``show PLAN --html PLAN``) would
    destroy it: refused before any work."""
    from whalepy.files import same_or_inside

    for name in _INPUTS:
        given = getattr(args, name, None)
        if isinstance(given, str) and given and os.path.exists(given) and same_or_inside(value, given):
            raise ArgumentError(f"{_flag(dest)} {value}: that is an input of the same command ({given}), "
                                "which writing would destroy; give another path")


def _check_run(args: argparse.Namespace) -> None:
    """``whalepy run``'s launch flags, which torchrun would otherwise refuse with a traceback."""
    n = getattr(args, "nproc_per_node", None)
    if n is not None and n not in ("gpu", "cpu", "auto") and not (n.isdigit() and int(n) > 0):
        raise ArgumentError(f"-n {n}: processes per node is a positive integer or gpu / cpu / auto; e.g. -n 4")
    nnodes = getattr(args, "nnodes", None)
    if nnodes is not None:
        parts = str(nnodes).split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or (
                len(parts) == 2 and int(parts[0]) > int(parts[1])):
            raise ArgumentError(f"--nnodes {nnodes}: give a positive node count, or MIN:MAX with MIN <= MAX; "
                                "e.g. --nnodes 2")
    port = getattr(args, "master_port", None)
    if port is not None and not 0 < port < 65536:
        raise ArgumentError(f"--master-port {port}: a TCP port is 1 to 65535")


def _installed(module: str) -> bool:
    import importlib.util
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None  # None: import blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _optional_extras(args: argparse.Namespace) -> None:
    """The optional packages a command will need, looked up (not imported) before any work: a missing
    one is one line naming the extra, not a failure after the planning or the study."""
    needs = []
    if getattr(args, "plot", None):
        needs.append(("matplotlib", "plot", "--plot", "leave out --plot"))
    if getattr(args, "command", None) == "export":
        needs.append(("safetensors", "hf", "whalepy export", "export from Python with pm.full_state_dict()"))
    for module, extra, what, other in needs:
        if not _installed(module):
            raise ArgumentError(f"{what} needs {module}: pip install 'whalepy[{extra}]' (or {other})")


def check_cli_args(args: argparse.Namespace) -> None:
    """Raise :class:`ArgumentError` for a value no command can use; a no-op for commands without them."""
    for dest in ("global_batch", "seq_len", "dp", "tp", "pp", "microbatches", "max_tp", "ilp_node_limit"):
        _positive(args, dest)
    for dest in ("time_limit",):
        _positive(args, dest, kind="number of seconds")
    _comma_list(args, "zero_stages", ("0", "1", "2", "3"))
    _comma_list(args, "schedules", _SCHEDULES)
    if getattr(args, "schedule", None) is not None and args.schedule not in _SCHEDULES:
        raise ArgumentError(f"--schedule {args.schedule}: use one of {', '.join(_SCHEDULES)}")
    if getattr(args, "zero", None) is not None and args.zero not in (0, 1, 2, 3):
        raise ArgumentError(f"--zero {args.zero}: a ZeRO stage is 0, 1, 2 or 3")
    max_tp = getattr(args, "max_tp", None)
    if max_tp and max_tp & (max_tp - 1):
        raise ArgumentError(f"--max-tp {max_tp}: must be a power of two (1, 2, 4, 8, ...)")
    _check_run(args)
    _output_paths(args)
    _optional_extras(args)
    if getattr(args, "command", None) == "show" and (args.model or args.seq_len) and not args.check:
        raise ArgumentError(f"{'--model' if args.model else '--seq-len'} is used by --check only; add --check to "
                            "check the plan against the model, or drop it")
    model = getattr(args, "model", None)
    if model and ":" in model and not model.startswith("synthetic:") and getattr(args, "seq_len", None):
        raise ArgumentError(f"--seq-len applies to built-in and synthetic: models; {model} returns its own "
                            "example inputs: give them the sequence length you want instead")


def one_line_usage_errors(parser: argparse.ArgumentParser) -> None:
    """argparse's own errors (an unknown choice, a missing or non-integer value) as one ``[whalepy] error:``
    line pointing at ``--help``, instead of the usage block followed by the error."""
    def patch(p: argparse.ArgumentParser) -> None:
        def error(message: str) -> None:  # argparse's signature; it must not return
            import sys

            print(f"[whalepy] error: {p.prog}: {message}; see `{p.prog} --help`", file=sys.stderr)
            raise SystemExit(2)

        p.error = error  # type: ignore[method-assign]
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    patch(sub)

    patch(parser)
