"""The docs, comments and docstrings speak of the project only: what it does, what was measured on what
machine type, with which command. Not the circumstances of the work: no path of a particular machine, no
issue number, no design file kept outside the repository, no work sessions or machines lent to someone.
Raw outputs of commands under docs/measurements/ are data (they name the run directory they wrote) and
are not read here."""
from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from topology.experiment import ExperimentConfig
from topology.schema import GroupSection

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


# --- links and names: a doc names only what exists ----------------------------------------------------------
# Checked in README.md and every .md under docs/ (outside fenced code blocks, which show output and layouts):
# - a relative link [text](target): the file or folder `target` names (less any #anchor) exists;
# - a path in backticks that starts with a folder of the repository (`actors/trainer/step.py`,
#   `topology/local.yaml`, `docs/measurements/`): it exists (placeholders such as <name> are not paths);
# - a dotted name in backticks that starts with one of our packages (`transport.files.atomic_write`,
#   `actors.weight_sync.base.WeightSender.publish`, `tools.plan`): its longest prefix that is a module of
#   ours exists, the next name is defined or imported in that module, and a name after a class is a member
#   of that class (below). Two kinds of configuration key share those first names:
#   `algo.KEY` that is no module of algo is a key of the experiment's algo section (checked as below), and
#   `actors.GROUP.KEY...` with KEY a group's key (topology.schema.GroupSection: `actors.trainer.settings`)
#   is a topology path, whose group names are the file's own and are not checked;
# - an experiment configuration key in backticks, `section.key` (`algo.kl_coef`, `gen.max_new_tokens`):
#   section is a section of topology.experiment.ExperimentConfig and key one of its fields (a file name such
#   as `eval.jsonl` or `model.safetensors` is not a key);
# - `Class.member` in backticks, where Class is a class defined in our packages (`BufferState.take_batch`):
#   member is a method, class attribute, annotated field, nested class or `self.member = ...` of that class
#   or of a base class of ours, or a dunder (`__init__`) every class has. A CamelCase name that is no class
#   of ours (`F.scaled_dot_product_attention`, SGLang's `ReqState`) is not checked: that is another project's
#   name; one that shares the name of a class of ours is written with its package
#   (`transformers.Qwen2ForCausalLM.from_pretrained`).
PACKAGES = ("actors", "algo", "configs", "testsupport", "tools", "topology", "transport")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(rf"({'|'.join(PACKAGES)})(\.[A-Za-z_]\w*)+(\(\))?")
CONFIG_KEY = re.compile(r"([a-z_]+)\.([a-z_]\w*)")
# `eval.jsonl`, `model.safetensors`, `model.py` are file names, not configuration keys.
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "md", "txt", "sh", "safetensors", "pt", "bin", "log", "csv", "png"}
CLASS_MEMBER = re.compile(r"([A-Z]\w*)\.([A-Za-z_]\w*)(\(\))?")
REPO_PATH = re.compile(rf"(?:{'|'.join(PACKAGES)}|tests|docs)/[\w./-]*")


def doc_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted(p for p in (root / "docs").rglob("*.md") if "measurements" not in p.parts)]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def class_members(node: ast.ClassDef) -> set[str]:
    names = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item is not node:
            names.add(item.name)
        elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) \
                and isinstance(item.value, ast.Name) and item.value.id in ("self", "cls"):
            names.add(item.attr)
    for item in node.body:
        targets = item.targets if isinstance(item, ast.Assign) else [item.target] \
            if isinstance(item, (ast.AnnAssign, ast.AugAssign)) else []
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    """Names a module defines or imports at its top level (inside a top-level if/try too), each with its node."""
    statements = []
    for node in tree.body:
        statements.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            statements += [item for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                                              *(h.body for h in getattr(node, "handlers", []))) for item in block]
    names: dict[str, ast.AST] = {}
    for item in statements:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[item.name] = item
        elif isinstance(item, ast.Assign):
            names.update((t.id, item) for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names[item.target.id] = item
        elif isinstance(item, (ast.Import, ast.ImportFrom)):
            names.update(((a.asname or a.name).split(".")[0], item) for a in item.names)
    return names


class Code:
    """Our packages' modules and classes, read with ast (nothing is imported)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, ast.Module] = {}
        self.classes: dict[str, list[ast.ClassDef]] = {}
        self.packages: set[str] = set()
        for package in PACKAGES:
            for path in sorted((root / package).rglob("*.py")):
                parts = list(path.relative_to(root).with_suffix("").parts)
                tree = ast.parse(path.read_text(), str(path))
                module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                self.trees[module] = tree
                if parts[-1] == "__init__":
                    self.packages.add(module)
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        self.classes.setdefault(node.name, []).append(node)

    def has_member(self, class_name: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        if member.startswith("__") and member.endswith("__"):
            return True   # every class has __init__ and the like (a dataclass's are generated)
        for node in self.classes.get(class_name, []):
            if member in class_members(node):
                return True
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                if name in self.classes and name not in seen and self.has_member(name, member, seen | {class_name}):
                    return True
        return False

    def dotted_problem(self, name: str) -> str | None:
        parts = name.removesuffix("()").split(".")
        cut = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in self.trees), 0)
        if not cut:
            return f"no module {parts[0]!r}"
        module, rest = ".".join(parts[:cut]), parts[cut:]
        if not rest:
            return None
        if module == parts[0] == "algo" and len(parts) == 2 and parts[1] not in top_level_names(self.trees[module]):
            return self.config_key_problem(*parts)   # `algo.kl_coef`: the experiment's algo section
        if parts[0] == "actors" and len(parts) >= 3 and parts[2] in GroupSection.model_fields \
                and ".".join(parts[:3]) not in self.trees:
            return None   # `actors.trainer.settings`: a topology's group (named by its file) and its key
        defined = top_level_names(self.trees[module])
        if rest[0] not in defined:
            return f"{module} has no {rest[0]!r}"
        owner = defined[rest[0]]
        for member in rest[1:]:
            if not isinstance(owner, ast.ClassDef):
                return f"{'.'.join(parts[:parts.index(member)])} is not a class of ours, so .{member} cannot be checked"
            if not self.has_member(owner.name, member):
                return f"class {owner.name} ({module}) has no {member!r}"
            owner = next((n for n in ast.walk(owner) if isinstance(n, ast.ClassDef) and n.name == member), None)
        return None

    @staticmethod
    def config_key_problem(section: str, key: str) -> str | None:
        field = ExperimentConfig.model_fields.get(section)
        model = next((t for t in typing.get_args(field.annotation) or (field.annotation,)
                      if isinstance(t, type) and issubclass(t, BaseModel)), None) if field else None
        if model is None or key in model.model_fields:
            return None
        return f"the experiment section {section!r} has no key {key!r}"

    def class_member_problem(self, class_name: str, member: str) -> str | None:
        if class_name not in self.classes or self.has_member(class_name, member):
            return None
        return f"class {class_name} has no {member!r}"


def doc_problems(page: Path, text: str, code: Code) -> list[str]:
    """What `page` (its text `text`) links to or names that does not exist, one line each."""
    out = []
    for number, line in prose_lines(text):
        for m in LINK.finditer(line):
            target = m.group(1).split("#")[0]
            if target and not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                out.append(f"line {number}: link to a missing file {m.group(1)!r}")
        for m in CODE.finditer(line):
            span = m.group(1)
            if REPO_PATH.fullmatch(span):
                if not (code.root / span).exists():
                    out.append(f"line {number}: `{span}` names a missing path")
            elif DOTTED.fullmatch(span):
                if problem := code.dotted_problem(span):
                    out.append(f"line {number}: `{span}`: {problem}")
            elif (key := CONFIG_KEY.fullmatch(span)) and key.group(2) not in FILE_SUFFIXES \
                    and (problem := code.config_key_problem(*key.group(1, 2))):
                out.append(f"line {number}: `{span}`: {problem}")
            elif (cm := CLASS_MEMBER.fullmatch(span)) and (problem := code.class_member_problem(*cm.group(1, 2))):
                out.append(f"line {number}: `{span}`: {problem}")
    return out


@pytest.fixture(scope="module")
def code() -> Code:
    return Code(ROOT)


def test_docs_link_and_name_only_what_exists(code: Code) -> None:
    found = {}
    for page in doc_pages(ROOT):
        if problems := doc_problems(page, page.read_text(), code):
            found[str(page.relative_to(ROOT))] = problems
    assert not found, f"docs naming what does not exist (fix the doc, or the name it should say): {found}"


@pytest.mark.parametrize("line", [
    "see [the trainer](../actors/trainer.py) for the loop",
    "see [the step](../actors/train_step.py#one-step)",
    "`BufferState.take_batches` cuts the batch",
    "`actors.weight_sync.base.in_thread` runs collectives",
    "`transport.files.atomic_writer`",
    "`actors.nowhere.thing`",
    "`actors/trainer.py` holds it",
    "`actors.runtime.threads.in_thread.x` is a function's member", "`actors.trainer.stepp.train_share`",
    "`algo.kl_coeff` sets the penalty", "`gen.max_tokens` caps an answer",
])
def test_the_name_check_refuses_each_kind(code: Code, line: str) -> None:
    assert doc_problems(ROOT / "docs" / "page.md", line, code)


@pytest.mark.parametrize("line", [
    "see [architecture](architecture.md#the-map) and [the code](../actors/trainer/step.py)",
    "[peers](https://github.com/areal-project/AReaL) and [above](#layout)",
    "`BufferState.take_batch`, `TrainerActor.Settings`, `actors.runtime.threads.in_thread`, `tools.plan`",
    "`transport.files.atomic_write()`, `F.scaled_dot_product_attention`, "
    "`transformers.Qwen2ForCausalLM.from_pretrained`, `actors.weight_sync.base.WeightSender.publish`",
    "```\n[shown output](../nowhere.py) `actors.nowhere`\n```",
    "`tools/bench/<name>.py` and `RUN_DIR/plan.txt` and `topology/local.yaml`",
    "`algo.kl_coef`, `algo.ppo`, `actors.trainer.settings`, `actors.rollout.settings.sglang`, `eval.jsonl`, "
    "`model.safetensors`, `model.path`, `SamplingParams.__init__`",
])
def test_the_name_check_leaves_what_exists(code: Code, line: str) -> None:
    assert not doc_problems(ROOT / "docs" / "page.md", line, code)
