"""Extract the code examples of README.md and docs/*.md, with the directives that say how to run them.

Every fenced block has a language. ``python`` / ``py`` blocks and ``bash`` / ``sh`` / ``shell`` /
``console`` blocks are run by ``tests/test_docs_examples.py`` unless marked skipped; other languages
(``text`` for output, ``yaml``, ``json``, ...) are not run, except ``text`` blocks that show the output
of a command (``output-of``), which are compared with what the command prints now.

Directives are HTML comments (invisible on GitHub) on the lines right above a fence:

- ``<!-- docs-test: skip REASON -->``: not run; the reason is required.
- ``<!-- docs-test: replace OLD => NEW -->``: run with OLD replaced (reduced sizes, a CPU cluster);
  OLD must occur in the block, so an edited example cannot silently drop its substitution.
- ``<!-- docs-test: torchrun N -->``: a Python block run under ``torchrun --nproc-per-node N`` (gloo
  on CPU); the torchrun blocks of one page with the same N run in one launch, in page order.
- ``<!-- docs-test: setup`` ... ``-->``: code run before the block (what the surrounding prose assumes:
  imports, a small model); ``<!-- docs-test: check`` ... ``-->``: code run after it (assertions).
- ``<!-- docs-test: output-of COMMAND -->`` above a ``text`` block: the block is COMMAND's output;
  lines with timings (``solve time``, ``captured ... in``, and the MIP gap, which depends on where a
  time limit stops the solver) are compared with their numbers masked.
  ``WHALEPY_DOCS_REGEN=1`` rewrites such blocks from the code instead of comparing.

The Python blocks of a page share one namespace, top to bottom, as a reader would run them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(\w[\w-]*)\s*(.*?)\s*(-->)?\s*$")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Block:
    path: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    code: str
    end: int
    """1-based line of the closing fence."""
    skip: str | None = None
    replace: list[tuple[str, str]] = field(default_factory=list)
    torchrun: int | None = None
    setup: str = ""
    check: str = ""
    output_of: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        return "python" if self.lang in PYTHON else "shell" if self.lang in SHELL else "other"

    def runnable(self) -> str:
        """The code to run: setup, the block with its replacements, check."""
        code = self.code
        for old, new in self.replace:
            code = code.replace(old, new)
        return "\n".join(c for c in (self.setup, code, self.check) if c)


def _directives(lines: list[str], fence: int) -> list[tuple[str, str, int]]:
    """``(name, argument, line)`` of the directive comments right above line index ``fence``."""
    found: list[tuple[str, str, int]] = []
    i = fence - 1
    while i >= 0:
        if lines[i].rstrip().endswith("-->") and "docs-test:" not in lines[i]:
            start = i  # the closing line of a multi-line directive: find its opening
            while start >= 0 and "<!--" not in lines[start]:
                start -= 1
            m = DIRECTIVE.match(lines[start]) if start >= 0 else None
            if not m:
                break
            body = "\n".join(lines[start + 1:i])
            found.append((m.group(1), (m.group(2) + "\n" + body).strip("\n"), start))
            i = start - 1
            continue
        m = DIRECTIVE.match(lines[i])
        if not m or not m.group(3):
            break
        found.append((m.group(1), m.group(2), i))
        i -= 1
    return found[::-1]


def parse(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence[0] * len(fence)):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]]
        b = Block(path, i + 1, lang, "\n".join(body) + "\n", j + 1)
        for name, arg, at in _directives(lines, i):
            _apply(b, name, arg, at + 1)
        blocks.append(b)
        i = j + 1
    return blocks


def _apply(b: Block, name: str, arg: str, line: int) -> None:
    if name == "skip":
        b.skip = arg
        if not arg:
            b.errors.append(f"line {line}: skip needs a reason")
    elif name == "replace":
        old, sep, new = (arg[:-3], " =>", "") if arg.endswith(" =>") else arg.partition(" => ")
        if not sep:
            b.errors.append(f"line {line}: replace takes 'OLD => NEW'")
        elif old not in b.code:
            b.errors.append(f"line {line}: replace: {old!r} does not occur in the block")
        else:
            b.replace.append((old, new))
    elif name == "torchrun":
        if not arg.isdigit():
            b.errors.append(f"line {line}: torchrun takes a process count")
        else:
            b.torchrun = int(arg)
    elif name in ("setup", "check"):
        setattr(b, name, getattr(b, name) + arg + "\n")
    elif name == "output-of":
        b.output_of = arg
    else:
        b.errors.append(f"line {line}: unknown directive {name!r}")


def problems(b: Block) -> list[str]:
    """Why ``b`` is neither run nor explicitly marked (empty when it is fine)."""
    out = [f"{b.where}: {e}" for e in b.errors]
    if not b.lang:
        out.append(f"{b.where}: a fence without a language; use ```text for output, ```python or ```bash "
                   "for code (run by tests/test_docs_examples.py unless marked <!-- docs-test: skip REASON -->)")
    if b.output_of is not None and b.lang != "text":
        out.append(f"{b.where}: output-of belongs above a ```text block")
    if b.torchrun is not None and b.kind != "python":
        out.append(f"{b.where}: torchrun applies to python blocks")
    if b.kind == "other" and (b.replace or b.setup or b.check) :
        out.append(f"{b.where}: directives on a {b.lang or 'plain'} block, which is not run")
    return out


MASKS = [re.compile(p) for p in (r"solve time [\d.]+ s", r"in [\d.]+ s\b", r"\d+ of \d+ candidates pruned",
                                 r"\b\d+ candidates\b", r"MIP gap [\d.]+%")]


def mask(text: str) -> str:
    """Output with run-to-run numbers (timings of the search and capture) blanked."""
    for m in MASKS:
        text = m.sub(lambda x: re.sub(r"\d[\d.]*", "#", x.group(0)), text)
    return text
