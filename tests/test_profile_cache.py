"""The ``whalepy`` command's stored profiles of built-in models (whalepy.tools.profile_cache) and its
default global batch (a built-in model's published batch): a stored profile gives the same plan as a
capture, a changed input or a damaged file captures again, and a plan from a stored profile imports no
torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from whalepy.tools import profile_cache
from whalepy.tools.cli import main

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
CLUSTER = str(CLUSTERS / "h100_8x8.yaml")
GPT2 = ["plan", "gpt2", "--cluster", CLUSTER, "--seq-len", "32", "--global-batch", "16"]


def _timeless(text: str) -> list[str]:
    return [line for line in text.splitlines() if "solve time" not in line]


def _timeless_json(d):  # type: ignore[no-untyped-def]
    if isinstance(d, dict):
        return {k: _timeless_json(v) for k, v in d.items() if k != "solve_time_s"}
    return [_timeless_json(x) for x in d] if isinstance(d, list) else d


def _plan_json(path: Path) -> dict:
    return _timeless_json(json.loads(path.read_text()))


@pytest.fixture()
def store(tmp_path, monkeypatch) -> Path:  # type: ignore[no-untyped-def]
    d = tmp_path / "profiles"
    monkeypatch.setenv(profile_cache.CACHE_DIR_ENV, str(d))
    return d


def test_stored_profile_hit_miss_and_damage(store, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    runs = {}
    for name, extra in (("cold", []), ("warm", []), ("no_cache", ["--no-cache"])):
        out = tmp_path / f"{name}.json"
        assert main([*GPT2, *extra, "--out", str(out)]) == 0
        text = capsys.readouterr()
        runs[name] = (text.out, _plan_json(out))
        captured, read = "capturing gpt2" in text.err, "read the stored profile" in text.err
        assert (captured, read) == {"warm": (False, True)}.get(name, (True, False)), (name, text.err)
    files = sorted(store.glob("*.pkl"))
    assert len(files) == 1  # --no-cache wrote nothing
    for name in ("warm", "no_cache"):  # the same plan, printed and saved, with and without the store
        assert _timeless(runs[name][0]) == _timeless(runs["cold"][0]) and runs[name][1] == runs["cold"][1]

    # another input is another entry: the sequence length, the capture code, torch's default dtype
    assert main([*GPT2[:-4], "--seq-len", "64", "--global-batch", "16", "-q"]) == 0
    assert len(list(store.glob("*.pkl"))) == 2
    key = profile_cache.cache_key("gpt2", batch=1, seq_len=32)
    assert profile_cache.cache_path(key) == files[0]
    assert key != profile_cache.cache_key("gpt2", batch=1, seq_len=64)
    assert profile_cache.cache_key(" GPT2 ", batch=1, seq_len=32) == key

    # damaged: a truncated file, then one that is not a pickle; then another entry's file under this name
    good = files[0].read_bytes()
    for damage in (good[: len(good) // 2], b"not a pickle"):
        files[0].write_bytes(damage)
        assert main([*GPT2, "-q"]) == 0
        err = capsys.readouterr().err
        assert "is damaged" in err and "capturing again" in err and "Traceback" not in err, err
        assert files[0].read_bytes() != damage  # replaced by a good entry
    files[0].chmod(0o666)  # writable by others: not read (a pickle runs code as it loads)
    assert main([*GPT2, "-q"]) == 0
    assert "not yours alone" in capsys.readouterr().err and files[0].stat().st_mode & 0o777 == 0o600
    other = next(p for p in store.glob("*.pkl") if p != files[0])
    files[0].write_bytes(other.read_bytes())
    assert main([*GPT2, "-q"]) == 0
    assert "holds another profile" in capsys.readouterr().err
    assert main([*GPT2, "--out", str(tmp_path / "again.json")]) == 0
    text = capsys.readouterr()
    assert "read the stored profile" in text.err and _plan_json(tmp_path / "again.json") == runs["cold"][1]


def test_key_follows_the_capture_code_and_default_dtype(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    key = profile_cache.cache_key("gpt2", batch=1, seq_len=None)
    monkeypatch.setattr(profile_cache, "source_digest", lambda: "0" * 64)
    assert profile_cache.cache_key("gpt2", batch=1, seq_len=None) != key
    monkeypatch.undo()
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert profile_cache.cache_key("gpt2", batch=1, seq_len=None) != key
    finally:
        torch.set_default_dtype(before)


def test_unwritable_store_is_a_note_and_the_plan_goes_on(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(profile_cache.CACHE_DIR_ENV, str(blocker / "profiles"))  # under a file: cannot mkdir
    assert main([*GPT2, "-q"]) == 0
    text = capsys.readouterr()
    assert "could not store the profile" in text.err and "step time" in text.out


def test_plan_from_a_stored_profile_imports_no_torch(store) -> None:  # type: ignore[no-untyped-def]
    """The second run reads the stored profile and plans without importing torch (the whole point: about
    2 s of a plan's CPU time are torch's imports)."""
    assert main([*GPT2, "-q"]) == 0  # captures and stores, in this process
    assert len(list(store.glob("*.pkl"))) == 1
    code = ("import sys; from whalepy.tools.cli import main; code = main(sys.argv[1:]); "
            "print('torch' in sys.modules, file=sys.stderr); sys.exit(code)")
    r = subprocess.run([sys.executable, "-c", code, *GPT2], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "read the stored profile" in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "False" and "step time" in r.stdout, r.stderr


def test_default_batch_is_the_published_one_and_the_plan_says_so(store, capsys) -> None:  # type: ignore[no-untyped-def]
    from whalepy.tools.model_arg import default_global_batch

    assert default_global_batch("gpt3-175b", None, 1024) == (1536, "GPT-3's published batch; --global-batch to change")
    assert default_global_batch("GPT3-175B", 2048, 64)[0] == 1536
    assert default_global_batch("gpt3-175b", 1024, 64) == (512, "8 per device; --global-batch to change")
    assert default_global_batch("llama3-8b", None, 64)[0] == 512  # none published
    assert default_global_batch("mt5-xl", None, 64)[0] == 512  # published at 1,024 tokens, built at 512
    assert default_global_batch("mt5-xl", 1024, 64)[0] == 1024
    assert default_global_batch("synthetic:gpt2", None, 64)[0] == 512  # not a built-in model

    assert main(["plan", "gpt2", "--cluster", CLUSTER, "-q"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "global batch 512 (GPT-2's published batch; --global-batch to change)," in head, head
    assert main(["plan", "synthetic:gpt2", "--cluster", CLUSTER, "-q"]) == 0
    assert "global batch 512 (8 per device; --global-batch to change)," in capsys.readouterr().out
    assert main(["plan", "gpt2", "--cluster", CLUSTER, "--global-batch", "512", "-q"]) == 0
    assert "global batch 512, " in capsys.readouterr().out  # given: nothing to say
    assert main(["estimate", "gpt2", "--cluster", CLUSTER, "--dp", "64", "-q"]) == 0
    assert "  global batch 512 (GPT-2's published batch; --global-batch to change)" in capsys.readouterr().out
    big = str(CLUSTERS / "a100_128x8.yaml")  # 1,536 over 1,024 replicas: refused before the capture
    assert main(["estimate", "gpt3-175b", "--cluster", big, "--dp", "1024", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(1536 is the default: GPT-3's published batch; --global-batch to change)" in err, err
