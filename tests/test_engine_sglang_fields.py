"""What the SGLang engine sends matches SGLang's own source, read without importing it, at both ends of the
supported range (SGLANG_VERSIONS: the oldest and the newest release of pyproject's `gpu` extra).

Each release's wheel is downloaded once with `pip download --no-deps` into a cache directory
(SGLANG_WHEEL_CACHE, default ~/.cache/areal-lite/sglang) and its source parsed with `ast`: request classes of
`sglang.srt.managers.io_struct` (dataclasses in 0.5.6, msgspec Structs in 0.5.23: fields, inherited ones
included; required fields), the fields of `SamplingParams` (and, where the release has it, of the HTTP
contract `sglang.api.v1.api_types` that refuses any other key), the HTTP routes of
`entrypoints/http_server.py`, the meta_info keys set in `managers/tokenizer_manager.py` and the launch_server
flags, derived as the release builds its parser. Skipped, with the reason, only if a wheel cannot be had."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import pytest

from actors.engines.sglang_routes import (GET_ROUTES, META_INFO_KEYS, ROUTED_EXPERTS_FIELDS, ROUTED_EXPERTS_FLAG,
                                          ROUTED_EXPERTS_SINCE, ROUTES, SAMPLING_FIELDS, SGLANG_VERSION,
                                          SGLANG_VERSIONS, WEIGHT_SESSION_ROUTES)
from actors.engines.sglang_server import LaunchConfig

ROOT = Path(__file__).resolve().parent.parent
OLDEST, NEWEST = SGLANG_VERSIONS[0], SGLANG_VERSIONS[-1]


def _wheel(version: str) -> Path:
    cache_dir = Path(os.environ.get("SGLANG_WHEEL_CACHE", Path.home() / ".cache" / "areal-lite" / "sglang"))
    cache_dir.mkdir(parents=True, exist_ok=True)
    pattern = f"sglang-{version}-*.whl"
    found = sorted(cache_dir.glob(pattern))
    if not found:
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                                   "-q", "-d", str(cache_dir), f"sglang=={version}"],
                                  capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"could not download the sglang=={version} wheel: {exc}")
        found = sorted(cache_dir.glob(pattern))
        if proc.returncode != 0 or not found:
            pytest.skip(f"could not download the sglang=={version} wheel (pip exit {proc.returncode}): "
                        f"{proc.stderr.strip()[-300:]}")
    return found[0]


class Release:
    """One release's wheel, its files read and parsed on demand."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.wheel = zipfile.ZipFile(_wheel(version))
        self.names = set(self.wheel.namelist())

    def text(self, path: str) -> str:
        """A file under sglang/ (``srt/...`` or ``api/...``)."""
        return self.wheel.read(f"sglang/{path}").decode()

    def has(self, path: str) -> bool:
        return f"sglang/{path}" in self.names

    @cache
    def tree(self, path: str) -> ast.Module:
        return ast.parse(self.text(path))


@pytest.fixture(scope="module", params=SGLANG_VERSIONS)
def release(request) -> Release:
    return Release(request.param)


def record_fields(module: ast.Module) -> dict[str, dict[str, bool]]:
    """class name -> {field: has a default}, inherited fields of classes in the same module included (a
    dataclass's or a msgspec Struct's: both are annotated class attributes)."""
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


def route_methods(release: Release) -> dict[str, set[str]]:
    methods: dict[str, set[str]] = {}
    for node in ast.walk(release.tree("srt/entrypoints/http_server.py")):
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
    return methods


def test_request_fields_match_io_struct(release):
    classes = record_fields(release.tree("srt/managers/io_struct.py"))
    problems = []
    for route, (cls, sent) in ROUTES.items():
        if cls not in classes:
            if route in WEIGHT_SESSION_ROUTES and release.version == OLDEST:
                continue   # the oldest release has no weight-update sessions (test_weight_sessions_...)
            problems.append(f"{route}: io_struct has no class {cls}")
            continue
        known = classes[cls]
        unknown = sorted(set(sent) - set(known))
        missing = sorted(f for f, has_default in known.items() if not has_default and f not in sent)
        if unknown:
            problems.append(f"{route}: {cls} has no field(s) {unknown} (it has {sorted(known)})")
        if missing:
            problems.append(f"{route}: {cls} requires field(s) {missing} that we do not send")
    assert not problems, f"SGLang {release.version}: " + "\n".join(problems)


def test_routed_experts_are_a_field_and_a_flag_of_the_newest_release_only(release):
    # Routing replay sends return_routed_experts and launches with ROUTED_EXPERTS_FLAG where the release has
    # them (ROUTED_EXPERTS_SINCE); the oldest has neither, which the launch check and the stand-in refuse.
    fields = record_fields(release.tree("srt/managers/io_struct.py"))["GenerateReqInput"]
    has_fields = ROUTED_EXPERTS_FIELDS <= set(fields)
    has_flag = ROUTED_EXPERTS_FLAG in launch_flags(release)
    assert has_fields == has_flag == (release.version == ROUTED_EXPERTS_SINCE), (release.version, has_fields, has_flag)
    if release.has("api/v1/api_types.py"):   # the /generate contract ignores what it does not declare
        contract = release.text("api/v1/api_types.py")
        assert '"""sglang.api.v1.GenerateRequest: JSON object (unknown keys ignored)."""' in contract
        assert not ROUTED_EXPERTS_FIELDS & set(record_fields(release.tree("api/v1/api_types.py"))["GenerateRequest"])


def test_sampling_params_are_sglang_fields(release):
    [cls] = [n for n in release.tree("srt/sampling/sampling_params.py").body
             if isinstance(n, ast.ClassDef) and n.name == "SamplingParams"]
    inits = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    if inits:   # 0.5.6: a plain class whose __init__ takes them
        names = {a.arg for a in inits[0].args.args + inits[0].args.kwonlyargs} - {"self"}
    else:       # 0.5.23: a msgspec Struct whose annotated class attributes are its fields
        names = set(record_fields(release.tree("srt/sampling/sampling_params.py"))["SamplingParams"])
    assert SAMPLING_FIELDS <= names, f"SGLang {release.version}: not SamplingParams fields: " \
                                     f"{sorted(SAMPLING_FIELDS - names)}"
    if release.has("api/v1/api_types.py"):   # the /generate contract, which refuses unknown keys
        contract = record_fields(release.tree("api/v1/api_types.py"))
        assert SAMPLING_FIELDS <= set(contract["SamplingParams"]), sorted(SAMPLING_FIELDS - set(contract["SamplingParams"]))
        body = ROUTES["/generate"][1]
        assert body <= set(contract["GenerateRequest"]), sorted(body - set(contract["GenerateRequest"]))


def test_routes_exist_with_their_methods(release):
    methods = route_methods(release)
    expected = set(ROUTES) - (WEIGHT_SESSION_ROUTES if release.version == OLDEST else set())
    problems = [f"POST {r}" for r in sorted(expected) if "POST" not in methods.get(r, set())]
    problems += [f"GET {r}" for r in sorted(GET_ROUTES) if "GET" not in methods.get(r, set())]
    assert not problems, f"routes missing from SGLang {release.version}'s http_server.py: {problems}"


def test_weight_sessions_exist_in_the_newest_release_only(release):
    # The client opens a session where the server has the routes and takes HTTP 404 as "none": the oldest
    # release must not have them, the newest must require them for every bucket.
    methods = route_methods(release)
    has = {r for r in WEIGHT_SESSION_ROUTES if "POST" in methods.get(r, set())}
    updater = "srt/managers/scheduler_components/weight_updater.py"
    requires = release.has(updater) and "must run between " in release.text(updater)
    if release.version == OLDEST:
        assert not has and not requires
    else:
        assert has == WEIGHT_SESSION_ROUTES and requires


def test_the_weight_version_is_reported_by_model_info(release):
    # GET /model_info reports weight_version in both releases (0.5.23 has no GET /weight_version).
    [fn] = [n for n in ast.walk(release.tree("srt/entrypoints/http_server.py"))
            if isinstance(n, ast.AsyncFunctionDef) and n.name == "model_info"]
    keys = {k.value for d in ast.walk(fn) if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)}
    assert "weight_version" in keys and "GET" in route_methods(release)["/model_info"]


def test_meta_info_keys_are_set_by_the_tokenizer_manager(release):
    tree = release.tree("srt/managers/tokenizer_manager.py")
    keys = {k.value for node in ast.walk(tree) if isinstance(node, ast.Dict)
            for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    keys |= {node.slice.value for node in ast.walk(tree)
             if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
             and isinstance(node.slice.value, str)}
    assert META_INFO_KEYS <= keys, f"meta_info keys SGLang {release.version} does not set: " \
                                   f"{sorted(META_INFO_KEYS - keys)}"


def _literal_flags(module: ast.Module) -> set[str]:
    return {n.value for n in ast.walk(module) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and n.value.startswith("--")}


def _generated_flags(release: Release) -> set[str]:
    """The flags 0.5.23's add_cli_args_from_dataclass (arg_groups/arg_utils.py:298-) makes from ServerArgs'
    fields, which collect_input_fields gathers from the namespace classes in _INPUT_NAMESPACES
    (server_args.py:522-546; arg_groups/fields/): every field annotated A[T, "help"] or A[T, Arg(...)], as
    "--" + its name with "_" -> "-" (arg_utils.py:288-290) unless Arg names cli_name, plus Arg's aliases;
    none for Arg(no_cli=True)."""
    server_args = release.tree("srt/server_args.py")
    [namespaces] = [n.value for n in server_args.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in n.targets)]
    wanted = {e.id for e in namespaces.elts}
    flags: set[str] = set()
    found: set[str] = set()
    for path in sorted(p for p in release.names if p.startswith("sglang/srt/arg_groups/fields/") and p.endswith(".py")):
        for cls in release.tree(path.removeprefix("sglang/")).body:
            if not (isinstance(cls, ast.ClassDef) and cls.name in wanted):
                continue
            found.add(cls.name)
            for stmt in cls.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(stmt.annotation, ast.Subscript)
                        and isinstance(stmt.annotation.value, ast.Name) and stmt.annotation.value.id in ("A", "Annotated")
                        and isinstance(stmt.annotation.slice, ast.Tuple) and len(stmt.annotation.slice.elts) >= 2):
                    continue
                meta = stmt.annotation.slice.elts[1]
                options = {}
                if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
                    options = {kw.arg: kw.value for kw in meta.keywords}
                elif not (isinstance(meta, (ast.Constant, ast.JoinedStr, ast.BinOp))):
                    continue   # no Arg and no help text: not made a flag
                if "no_cli" in options and ast.literal_eval(options["no_cli"]):
                    continue
                name = ast.literal_eval(options["cli_name"]) if "cli_name" in options else \
                    "--" + stmt.target.id.replace("_", "-")
                flags.add(name)
                if "aliases" in options:
                    flags.update(ast.literal_eval(options["aliases"]))
    assert found == wanted, f"namespace classes not found under arg_groups/fields/: {sorted(wanted - found)}"
    return flags


def launch_flags(release: Release) -> set[str]:
    """launch_server's flags: the literals of server_args.py (every flag in 0.5.6; in 0.5.23 the ones
    add_cli_args registers by hand, server_args.py:351-444) and, where ServerArgs' parser is generated from
    its fields (0.5.23), the generated ones."""
    flags = _literal_flags(release.tree("srt/server_args.py"))
    if "add_cli_args_from_dataclass" in release.text("srt/server_args.py"):
        flags |= _generated_flags(release)
    return flags


def test_launch_flags_exist(release):
    flags = launch_flags(release)
    args = LaunchConfig(model_path="m", tp=2, ep=2, mem_fraction_static=0.8, dtype="bfloat16", seed=1, lora_rank=8,
                        lora_targets=("q_proj", "down_proj"), lora_paths={"v3": "/a"}).args(30000, 0)
    ours = {a for a in args if a.startswith("--")}
    assert "--ep-size" in ours
    assert ours <= flags, f"launch_server flags SGLang {release.version} does not have: {sorted(ours - flags)}"


def test_the_flag_derivation_sees_what_it_must_not():
    # The derivation of 0.5.23's flags is what the launch check rests on: it finds the flags of fields and
    # their aliases, and not a made-up one.
    flags = launch_flags(Release(NEWEST))
    assert {"--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--weight-version"} <= flags
    assert "--no-such-flag" not in flags and "--disable-cuda-graph" in flags   # a hand-registered one


def test_the_gpu_extra_names_both_ends_of_the_range():
    text = (ROOT / "pyproject.toml").read_text()
    pins = re.findall(r'"sglang(?:\[\w+\])?([^"]*)"', text)
    assert pins == [f">={OLDEST},<={NEWEST}"], f"pyproject's sglang requirement {pins}; the engine speaks " \
                                               f"{OLDEST} to {NEWEST}"
    assert SGLANG_VERSION == NEWEST


def test_every_line_the_standin_cites_holds_what_it_says(release):
    # The stand-in's strictness (testsupport/sglang_standin.py, docs/engines-sglang.md) cites each release's
    # source by file and line; each cited line must hold the text it is cited for, in that release.
    from testsupport.sglang_standin import CITATIONS

    assert set(CITATIONS) == set(SGLANG_VERSIONS)
    drifted = []
    for path, line, text in CITATIONS[release.version]:
        if not release.has(f"srt/{path}"):
            drifted.append(f"{path}: not in the {release.version} wheel")
            continue
        lines = release.text(f"srt/{path}").split("\n")
        if line > len(lines) or text not in lines[line - 1]:
            drifted.append(f"{path}:{line} does not hold {text!r}")
    assert not drifted, f"SGLang {release.version}: {drifted}"
