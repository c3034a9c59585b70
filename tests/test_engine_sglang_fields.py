"""What the SGLang engine sends matches SGLang's own source of the pinned release, read without importing it.

The wheel of sglang==SGLANG_VERSION (the version in pyproject's `gpu` extra) is downloaded once with
`pip download --no-deps` into a cache directory (SGLANG_WHEEL_CACHE, default ~/.cache/areal-lite/sglang) and
its source parsed with `ast`: request dataclasses of `sglang.srt.managers.io_struct` (fields, inherited ones
included; required fields), `SamplingParams.__init__` arguments, the HTTP routes of
`entrypoints/http_server.py`, the meta_info keys set in `managers/tokenizer_manager.py` and the
launch_server flags of `server_args.py`. Skipped, with the reason, only if the wheel cannot be had."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from actors.engines.sglang_routes import GET_ROUTES, META_INFO_KEYS, ROUTES, SAMPLING_FIELDS, SGLANG_VERSION
from actors.engines.sglang_server import LaunchConfig

ROOT = Path(__file__).resolve().parent.parent


def _wheel() -> Path:
    cache = Path(os.environ.get("SGLANG_WHEEL_CACHE", Path.home() / ".cache" / "areal-lite" / "sglang"))
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"sglang-{SGLANG_VERSION}-*.whl"
    found = sorted(cache.glob(pattern))
    if not found:
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                                   "-q", "-d", str(cache), f"sglang=={SGLANG_VERSION}"],
                                  capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"could not download the sglang=={SGLANG_VERSION} wheel: {exc}")
        found = sorted(cache.glob(pattern))
        if proc.returncode != 0 or not found:
            pytest.skip(f"could not download the sglang=={SGLANG_VERSION} wheel (pip exit {proc.returncode}): "
                        f"{proc.stderr.strip()[-300:]}")
    return found[0]


@pytest.fixture(scope="module")
def source():
    with zipfile.ZipFile(_wheel()) as wheel:
        def read(path: str) -> ast.Module:
            return ast.parse(wheel.read(f"sglang/srt/{path}").decode())
        return {name: read(path) for name, path in {
            "io_struct": "managers/io_struct.py", "sampling": "sampling/sampling_params.py",
            "http": "entrypoints/http_server.py", "tokenizer_manager": "managers/tokenizer_manager.py",
            "server_args": "server_args.py"}.items()}


def dataclass_fields(module: ast.Module) -> dict[str, dict[str, bool]]:
    """class name -> {field: has a default}, inherited fields of classes in the same module included."""
    classes = {n.name: n for n in module.body if isinstance(n, ast.ClassDef)}
    memo: dict[str, dict[str, bool]] = {}

    def fields(name: str) -> dict[str, bool]:
        if name in memo:
            return memo[name]
        node = classes[name]
        out: dict[str, bool] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if "ClassVar" in ast.unparse(stmt.annotation):
                    continue
                out[stmt.target.id] = stmt.value is not None
        memo[name] = out
        return out

    return {name: fields(name) for name in classes}


def test_request_fields_match_io_struct(source):
    classes = dataclass_fields(source["io_struct"])
    problems = []
    for route, (cls, sent) in ROUTES.items():
        if cls not in classes:
            problems.append(f"{route}: io_struct has no class {cls}")
            continue
        known = classes[cls]
        unknown = sorted(set(sent) - set(known))
        missing = sorted(f for f, has_default in known.items() if not has_default and f not in sent)
        if unknown:
            problems.append(f"{route}: {cls} has no field(s) {unknown} (it has {sorted(known)})")
        if missing:
            problems.append(f"{route}: {cls} requires field(s) {missing} that we do not send")
    assert not problems, "\n".join(problems)


def test_sampling_params_are_sglang_arguments(source):
    [cls] = [n for n in source["sampling"].body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams"]
    [init] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    args = {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}
    assert SAMPLING_FIELDS <= args, f"not SamplingParams arguments: {sorted(SAMPLING_FIELDS - args)}"


def test_routes_exist_with_their_methods(source):
    methods: dict[str, set[str]] = {}
    for node in ast.walk(source["http"]):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                    and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                continue
            path, kind = dec.args[0].value, dec.func.attr
            if kind in ("get", "post", "put"):
                methods.setdefault(path, set()).add(kind.upper())
            elif kind == "api_route":
                for kw in dec.keywords:
                    if kw.arg == "methods":
                        methods.setdefault(path, set()).update(ast.literal_eval(kw.value))
    problems = [f"POST {r}" for r in ROUTES if "POST" not in methods.get(r, set())]
    problems += [f"GET {r}" for r in GET_ROUTES if "GET" not in methods.get(r, set())]
    assert not problems, f"routes missing from SGLang {SGLANG_VERSION}'s http_server.py: {problems}"


def test_meta_info_keys_are_set_by_the_tokenizer_manager(source):
    keys = {k.value for node in ast.walk(source["tokenizer_manager"]) if isinstance(node, ast.Dict)
            for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    keys |= {node.slice.value for node in ast.walk(source["tokenizer_manager"])
             if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
             and isinstance(node.slice.value, str)}
    assert META_INFO_KEYS <= keys, f"meta_info keys SGLang does not set: {sorted(META_INFO_KEYS - keys)}"


def test_launch_flags_exist(source):
    flags = {n.value for n in ast.walk(source["server_args"]) if isinstance(n, ast.Constant)
             and isinstance(n.value, str) and n.value.startswith("--")}
    args = LaunchConfig(model_path="m", mem_fraction_static=0.8, dtype="bfloat16", seed=1, lora_rank=8,
                        lora_targets=("q_proj", "down_proj"), lora_paths={"v3": "/a"}).args(30000, 0)
    ours = {a for a in args if a.startswith("--")}
    assert ours <= flags, f"launch_server flags SGLang does not have: {sorted(ours - flags)}"


def test_pinned_version_is_the_gpu_extra():
    text = (ROOT / "pyproject.toml").read_text()
    pins = re.findall(r'"sglang(?:\[\w+\])?==([^"]+)"', text)
    assert pins == [SGLANG_VERSION], f"pyproject pins sglang {pins}, the engine speaks {SGLANG_VERSION}"


def test_every_line_the_standin_cites_holds_what_it_says():
    # The stand-in's strictness (testsupport/sglang_standin.py, docs/engines-sglang.md) cites SGLang's source
    # by file and line; each cited line must hold the text it is cited for.
    from testsupport.sglang_standin import CITATIONS

    with zipfile.ZipFile(_wheel()) as wheel:
        drifted = []
        for path, line, text in CITATIONS:
            lines = wheel.read(f"sglang/srt/{path}").decode().split("\n")
            if line > len(lines) or text not in lines[line - 1]:
                drifted.append(f"{path}:{line} does not hold {text!r}")
    assert not drifted, drifted
