"""README, docs, benchmarks, package and tests describe the product: no words about how its
development is organised (numbered work periods, tracker numbers, internal machine or recipe
names). Product words that look alike stay allowed (SGLang's streaming requests, a POSIX
process group, the GPU name in a cost-model file name)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCOPE = ["README.md", "docs", "benchmark", "python", "test"]
TEXT = {".md", ".py", ".sh", ".txt", ".toml", ".json", ".jsonl", ".log"}

# Built from pieces so that this file does not match itself.
_S = "sess" + "ion"
FORBIDDEN = re.compile("|".join([
    rf"\b{_S}s? [0-9]", r"\bnext " + _S, r"\bissues? #?[0-9]", "offline" + "-gpu",
    "nvidia-h200" + "-x[0-9]", "device " + "time", r"\bthe " + "lead\b", r"\bthe " + "team\b",
    r"\bfarm" + "-", r"\bS[1-9] →",
]), re.IGNORECASE)


def _files():
    for top in SCOPE:
        path = ROOT / top
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if f.is_file() and f.suffix in TEXT and "__pycache__" not in f.parts:
                yield f


def offending_lines(files):
    out = []
    for f in files:
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                out.append(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}:{n}: "
                           f"{line.strip()[:120]}")
    return out


def test_no_process_words_in_the_repository():
    bad = offending_lines(_files())
    assert not bad, "\n".join(bad)


def test_the_check_catches_a_planted_line(tmp_path):
    page = tmp_path / "page.md"
    planted = f"Measured in {_S} 6 on the " + "offline" + "-gpu host."
    page.write_text(planted + f"\nSGLang's streaming {_S}s and `start_new_{_S}=True` are fine.\n")
    bad = offending_lines([page])
    assert len(bad) == 1 and bad[0].endswith(":1: " + planted)
