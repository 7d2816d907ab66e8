"""Every file whalepy writes goes through one helper (issue 25, deliver 4): ``whalepy/files.py`` checks
the path first (a directory, a missing or read-only directory, an input of the same command) and writes
atomically. This test reads every module of whalepy (and its passes / cost models) and fails on a call
that writes a file anywhere else, except in the few places listed in ALLOWED with their reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("whalepy", "passes", "cost_models") for p in sorted((ROOT / d).rglob("*.py"))]

ALLOWED = {
    "whalepy/files.py": "the helper itself",
    "whalepy/runtime/commit.py": "checkpoint directories: written beside the path, checksummed, renamed (its "
                                  "own commit protocol, on every rank)",
    "whalepy/runtime/checkpointing.py": "DCP's own writer (dcp.save), into _commit's partial directory",
    "whalepy/runtime/_durable.py": "the disk tier's engine: atomic writes with fsync and a step manifest",
    "whalepy/runtime/metrics.py": "the JSONL sink appends one record per logged step to a log it keeps open "
                                  "(a log, not a document: an atomic rewrite per record would be quadratic)",
    "whalepy/runtime/_train_state.py": "torch.save into an in-memory buffer (the job state DCP then saves), no file",
    "whalepy/tools/calibrate_bench.py": "the disk benchmark's scratch file: measures raw write speed, then removed",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()"
    return "?"


def _atomic_names(tree: ast.AST) -> set[str]:
    """Names bound by ``with atomic_path(...) as NAME``: temporary files the helper renames into place."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if _dotted(item.context_expr.func if isinstance(item.context_expr, ast.Call) else item.context_expr
                           ).endswith("atomic_path") and isinstance(item.optional_vars, ast.Name):
                    names.add(item.optional_vars.id)
    return names


def _refers_to(arg: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(arg))


def _where(path: Path, node: ast.AST) -> str:
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return f"{shown}:{node.lineno}"


def _is_write(node: ast.Call, tmp: set[str]) -> bool:
    name = _dotted(node.func)
    last = name.rsplit(".", 1)[-1]
    receiver = _dotted(node.func.value) if isinstance(node.func, ast.Attribute) else ""
    args = node.args
    if any(_refers_to(a, tmp) for a in args) or receiver and _refers_to(node.func.value, tmp):
        return False  # the temporary file of atomic_path, renamed into place by the helper
    if args and _dotted(args[0]) == "os.devnull":
        return False
    if name in ("open", "io.open", "os.open", "os.fdopen"):
        mode = args[1] if len(args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
        if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
            return any(c in mode.value for c in "wax+")
        return mode is not None and any(f in _dotted(mode) for f in ("O_WRONLY", "O_RDWR", "O_CREAT"))
    if receiver in ("os", "shutil"):
        return last in ("replace", "rename", "renames", "link", "symlink", "copy", "copy2", "copyfile",
                        "copytree", "move", "truncate", "mkfifo")
    if receiver in ("json", "pickle", "torch", "np", "numpy", "yaml"):
        return last in ("dump", "save", "savez", "save_compressed")
    if receiver in ("dcp", "torch.distributed.checkpoint"):
        return last == "save"
    if receiver and last in ("write_text", "write_bytes", "savefig", "to_csv", "symlink_to", "hardlink_to",
                             "touch"):
        return True
    if last == "rename" and len(args) == 1:  # Path.rename (str has no rename)
        return True
    if last == "replace" and len(args) == 1 and not node.keywords and receiver not in ("dataclasses", "?"):
        return True  # Path.replace(target); str.replace takes two arguments, dataclasses.replace keywords
    return last in ("save_file", "mkstemp", "NamedTemporaryFile") and not receiver.startswith("self")


def _writes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    tmp = _atomic_names(tree)
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_write(n, tmp)),
                   key=lambda n: (n.lineno, n.col_offset))
    return [f"{_where(path, n)} {_dotted(n.func)}(...)" for n in calls]


def test_every_file_write_goes_through_the_helper() -> None:
    stray = [w for p in SOURCES if str(p.relative_to(ROOT)) not in ALLOWED for w in _writes(p)]
    assert not stray, "write these through whalepy.files (write_file / atomic_path):\n" + "\n".join(stray)


def test_the_audit_finds_writes(tmp_path: Path) -> None:
    """The audit is not vacuous: it finds the writes of the allowed modules and of a sample, and lets
    the helper's temporary files and look-alikes (str.replace, dataclasses.replace) pass."""
    assert len(_writes(ROOT / "whalepy/runtime/_durable.py")) >= 3  # open(tmp, "wb"), os.replace, probe
    assert _writes(ROOT / "whalepy/runtime/commit.py")
    sample = tmp_path / "sample.py"
    sample.write_text("import json, os, dataclasses\nfrom pathlib import Path\n\ndef f(p, d, fig):\n"
                      "    Path(p).write_text('x')\n    with open(p, 'w') as fh:\n        json.dump(d, fh)\n"
                      "    fig.savefig(p)\n    os.replace(p, p + '1')\n    Path(p).rename('q')\n"
                      "    open(p).read()\n    'a'.replace('a', 'b')\n    dataclasses.replace(d, x=1)\n"
                      "    with atomic_path(p) as tmp:\n        fig.savefig(tmp)\n        open(tmp, 'w')\n")
    assert [w.split()[1] for w in _writes(sample)] == [
        "Path().write_text(...)", "open(...)", "json.dump(...)", "fig.savefig(...)", "os.replace(...)",
        "Path().rename(...)"], _writes(sample)
