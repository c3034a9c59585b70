"""The docs, comments and docstrings speak of the project only: what it does, what was measured on what
machine type, with which command. Not the circumstances of the work: no path of a particular machine, no
issue number, no design file kept outside the repository, no work sessions or machines lent to someone.
Raw outputs of commands under docs/measurements/ are data (they name the run directory they wrote) and
are not read here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "a path of a particular machine": re.compile(r"(?<![\w.])/(?:work|home/\w+)/|/tmp/proto\b|~/\.pyenv|/root/\.pyenv"),
    "an issue number": re.compile(r"\bissues? #?\d+\b|\(#\d+\)|\bPR #?\d+\b", re.IGNORECASE),
    "a design file outside the repository": re.compile(r"DESIGN\.md|\.\./shared/"),
    "the circumstances of the work": re.compile(
        r"\b(?:another|same|later|earlier|this|other|one|debugging) sessions?\b|sessions' jobs|\bwork periods?\b"
        r"|\blent\b|\bthis work\b|\bthrow-?away scripts?\b", re.IGNORECASE),
}
# The tests of the sandbox name /root on purpose (a file only root may read); this module names the patterns.
SKIP = {"tests/test_docs.py"}


def texts() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for package in ("actors", "algo", "configs", "testsupport", "tests", "tools", "topology", "transport"):
        found += sorted(p for p in (ROOT / package).rglob("*") if p.suffix in (".py", ".yaml", ".md", ".sh"))
    found += sorted((ROOT / ".ci").glob("*")) if (ROOT / ".ci").is_dir() else []
    return [p for p in found if p.is_file() and "measurements" not in p.parts
            and str(p.relative_to(ROOT)) not in SKIP]


def offences(text: str) -> list[str]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if m := pattern.search(line):
                out.append(f"line {number}: {what} ({m.group(0)!r})")
    return out


def test_docs_and_comments_speak_of_the_project_only() -> None:
    found = {}
    for path in texts():
        if problems := offences(path.read_text(errors="replace")):
            found[str(path.relative_to(ROOT))] = problems
    assert not found, f"rewrite these as statements about the project: {found}"


@pytest.mark.parametrize("line", [
    "cd /work/main && python -m tools.up", "as issue 14's restructuring showed", "fixed in (#27)",
    "see ../shared/DESIGN.md section 9", "same machine type, another session", "no GPU was lent to this work",
    "Throw-away scripts in `/tmp/proto`",
])
def test_the_check_refuses_each_kind(line: str) -> None:
    assert offences(line)


@pytest.mark.parametrize("line", [
    "one aiohttp session per engine", "the program starts a new session first", "run.key under run_dir/curve/",
    "rendezvous #48:29400", "tests/test_reward_sandbox.py reads /root/.reward-sandbox-test",
])
def test_the_check_leaves_the_project_s_own_words(line: str) -> None:
    assert not offences(line)
