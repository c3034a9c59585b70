"""Inputs caught before launch, each with its line: the data files and the starting model are read as the
actors will read them (launch/inputs.py), in the dry run (a sample) and at launch (every line), and a run
directory that cannot be made is one line too. None of these may reach an actor or print a traceback."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import topology as topo_mod
from testsupport.tiny_models import tiny_model_dir
from launch.rundir import inputs_ok
from tools import up
from launch.inputs import check_inputs

REPO = Path(__file__).resolve().parent.parent
LOCAL = str(REPO / "topology" / "local.yaml")


def good_line(i: int) -> str:
    return json.dumps({"query_id": str(i), "prompt": f"{i}+1=", "answer": str(i + 1), "level": 1}) + "\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("inputs") / "model")


def overrides(model: Path, train: Path, *extra: str) -> list[str]:
    test = train.parent / "test.jsonl"
    if train.parent.is_dir() and not test.exists():
        test.write_text("".join(good_line(i) for i in range(4)))
    return [f"experiment.model.path={model}", f"experiment.data.train={train}", f"experiment.data.test={test}",
            *extra]


def plan_of(model: Path, train: Path, *extra: str) -> topo_mod.Plan:
    return topo_mod.load(LOCAL, overrides(model, train, *extra), check_imports=False)


BAD_FILES = {
    "missing": (None, "no such file"),
    "empty": (b"", "the file is empty"),
    "binary": (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4, "a binary file, not JSON lines (a NUL byte at offset 7)"),
    "gzip": (gzip.compress(good_line(0).encode()), "the file is gzip-compressed, not JSON lines: decompress it first"),
    "all bad": (b'{"prompt": 1}\nnot json\n', "none of its 2 lines is a usable record"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_an_unusable_data_file_fails_the_launch_with_one_line(case: str, model: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    # Each once reached the buffer, which died on it 4 times over 30-40 s with pages of tracebacks.
    content, words = BAD_FILES[case]
    train = tmp_path / "train.jsonl"
    if content is not None:
        train.write_bytes(content)
    args = [LOCAL, *overrides(model, train), "--run-dir", str(tmp_path / "run"), "--no-import-check"]
    assert up.main(args) == up.EXIT_INVALID
    err = capsys.readouterr().err
    assert f"experiment.data.train: {train}: {words}" in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "logs").exists()   # nothing started
    # the dry run reads the same file (a sample of it) and refuses it the same way; a missing file is only
    # noted there: the dry run may run where the data is not
    if case != "missing":
        assert up.main([*args[:-3], "--dry-run"]) == up.EXIT_INVALID
        assert words in capsys.readouterr().err


def test_the_dry_run_reads_a_sample_and_says_when_a_file_is_absent(model: Path, tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(good_line(i) for i in range(1500)))
    lines, problems = check_inputs(plan_of(model, train), launch=False)
    assert problems == [] and f"data.train {train}: 1000 records in the first 1000 lines" in lines, lines
    # a one-machine run reads its files on the machine it is launched on: absent here, they are missing
    missing = tmp_path / "elsewhere" / "train.jsonl"
    lines, problems = check_inputs(plan_of(model, missing), launch=False)
    assert problems == [] and f"data.train {missing}: missing: no such file or directory on this machine, where a " \
        "one-machine run reads it (a launch here refuses it)" in lines, lines
    # (a run of several nodes reads them on its nodes: tests/test_launch.py, the 64-node dry run)


def test_skipped_lines_are_listed_with_file_line_and_reason_and_a_share_fails(model: Path, tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    # Under on_bad_line: skip, a non-UTF-8 line and a 10 MB line were skipped with only a count in the log.
    train = tmp_path / "train.jsonl"
    body = [good_line(i).encode() for i in range(40)]
    body[4] = b'{"query_id": "x", "prompt": "caf\xe9"}\n'
    body[9] = b'{"prompt": "' + b"9" * (2 << 20) + b'"}\n'
    train.write_bytes(b"".join(body))
    assert inputs_ok(plan_of(model, train))
    out = capsys.readouterr().out
    assert f"data.train {train}: 38 records in every line, 2 malformed lines skipped" in out, out
    assert f"{train}:5: not valid UTF-8" in out and f"{train}:10: longer than max_line_bytes" in out, out
    assert not inputs_ok(plan_of(model, train, "experiment.data.max_bad_share=0.01"))
    err = capsys.readouterr().err
    assert f"experiment.data.train: {train}: 2 of 40 lines (5.0%, every line) are malformed, more than " \
           f"data.max_bad_share (0.01) allows" in err, err


def test_the_buffer_refuses_a_file_over_the_bad_share_too(tmp_path: Path) -> None:
    from actors.dataset import DatasetError, load_dataset
    train = tmp_path / "train.jsonl"
    train.write_text(good_line(0) + "no\n" + good_line(1))
    assert len(load_dataset(train, on_error="skip", max_bad_share=0.5)) == 2
    with pytest.raises(DatasetError, match=r"1 of 3 lines are malformed, more than data.max_bad_share \(0.2\)"):
        load_dataset(train, on_error="skip", max_bad_share=0.2)


def test_a_missing_model_path_is_one_line_at_launch(model: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(good_line(i) for i in range(4)))
    args = overrides(model, train)
    args[0] = f"experiment.model.path={tmp_path / 'nowhere'}"
    assert up.main([LOCAL, *args, "--run-dir", str(tmp_path / "run"), "--no-import-check"]) == up.EXIT_INVALID
    err = capsys.readouterr().err
    assert f"experiment.model.path: {tmp_path / 'nowhere'}: no such directory" in err and "Traceback" not in err, err


def test_max_new_tokens_beyond_the_models_context_is_refused(model: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(good_line(i) for i in range(4)))
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    args = [LOCAL, *overrides(model, train, f"experiment.gen.max_new_tokens={context}"), "--no-import-check"]
    assert up.main([*args, "--dry-run"]) == up.EXIT_INVALID
    assert f"experiment.gen.max_new_tokens: {context} leaves no room for a prompt in the model's context of " \
           f"{context} tokens" in capsys.readouterr().err
    assert up.main([*args, "--run-dir", str(tmp_path / "run")]) == up.EXIT_INVALID


def test_a_run_directory_that_cannot_be_made_is_one_line(model: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(good_line(i) for i in range(4)))
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should go")
    args = [LOCAL, *overrides(model, train), "--run-dir", str(blocker / "run"), "--no-import-check"]
    assert up.main(args) == up.EXIT_INVALID
    err = capsys.readouterr().err
    assert f"the run directory cannot be made: {blocker / 'run'}: Not a directory" in err and "Traceback" not in err, err


def test_an_answer_file_absent_here_is_noted_in_the_dry_run_and_refused_at_launch(model: Path, tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"query_id": str(i), "prompt": f"{i}+1="}) + "\n" for i in range(4)))
    plan = plan_of(model, train, f"experiment.data.id2info={tmp_path / 'id2info.json'}")
    lines, problems = check_inputs(plan, launch=False)
    assert problems == [] and any("data.id2info" in x and "missing: no such file or directory on this machine" in x for x in lines), lines
    lines, problems = check_inputs(plan, launch=True)
    assert problems == [f"experiment.data.id2info: {tmp_path / 'id2info.json'}: no such file (the answers of the "
                        f"data files)"], problems
    (tmp_path / "id2info.json").write_text(json.dumps({str(i): {"solutions": [f"\\boxed{{{i + 1}}}"]}
                                                        for i in range(4)}))
    lines, problems = check_inputs(plan, launch=True)
    assert problems == [] and f"data.train {train}: 4 records in every line" in lines, (lines, problems)


def test_an_unsupported_or_mismatched_model_is_refused_with_one_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    moe = tiny_model_dir(tmp_path / "moe", family="qwen3_moe")
    train = tmp_path / "data" / "train.jsonl"
    train.parent.mkdir()
    train.write_text("".join(good_line(i) for i in range(4)))
    lines, problems = check_inputs(plan_of(moe, train), launch=False)
    assert problems == [] and any("(qwen3_moe, 8 experts, top-2)" in line for line in lines), lines
    raw = json.loads((moe / "config.json").read_text())
    # An architecture none of our engines builds: named, with what is supported.
    (moe / "config.json").write_text(json.dumps({**raw, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert up.main([LOCAL, *overrides(moe, train), "--dry-run", "--no-import-check"]) == up.EXIT_INVALID
    err = capsys.readouterr().err
    assert "key 'model_type' is 'llama' (LlamaForCausalLM); supported: qwen2 (Qwen2ForCausalLM), qwen3 " \
           "(Qwen3ForCausalLM), qwen3_moe (Qwen3MoeForCausalLM)" in err and "Traceback" not in err, err
    # Weights that do not fit the config (fewer experts than the tensors hold), read from the files' headers.
    (moe / "config.json").write_text(json.dumps({**raw, "num_experts": 6}))
    _, problems = check_inputs(plan_of(moe, train), launch=True)
    assert len(problems) == 1 and "unexpected tensor 'model.layers.0.mlp.experts.6." in problems[0], problems
    # The Megatron backend builds Qwen3-MoE and replays the rollout's routing (r3), but not r2.
    (moe / "config.json").write_text(json.dumps(raw))
    plan = topo_mod.load(str(REPO / "topology" / "1node.yaml"), overrides(moe, train), check_imports=False)
    _, problems = check_inputs(plan, launch=False)
    assert not any("qwen3_moe" in p or "routing_replay" in p for p in problems), problems
    plan = topo_mod.load(str(REPO / "topology" / "1node.yaml"),
                         overrides(moe, train, "experiment.algo.routing_replay=r2"), check_imports=False)
    _, problems = check_inputs(plan, launch=False)
    assert [p for p in problems if "routing_replay" in p] == [
        "experiment.algo.routing_replay: r2 (the trainer records its own routing, then replays it) is not built on "
        "the megatron engine; use r3 (replay the rollout's routing) or none"], problems
    # r3 with SGLang rollouts: they return the routing (SGLang 0.5.23 or later; an older one installed here is
    # refused in one line, and none is installed on this machine).
    plan = topo_mod.load(str(REPO / "topology" / "1node.yaml"),
                         overrides(moe, train, "experiment.algo.routing_replay=r3"), check_imports=False)
    assert "sglang" in {s["settings"].get("engine") for s in plan.specs(tmp_path)}
    _, problems = check_inputs(plan, launch=False)
    assert not any("routing_replay" in p for p in problems), problems


def test_a_file_of_only_bad_lines_is_one_error_with_a_count(model: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    # 60 bad lines printed 60 per-line warnings, then the shown bad lines, before the error said the file was unusable.
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"query_id": str(i), "prompt": i}) + "\n" for i in range(60)))
    assert up.main([LOCAL, *overrides(model, train), "--run-dir", str(tmp_path / "run"), "--no-import-check"]) \
        == up.EXIT_INVALID
    captured = capsys.readouterr()
    said = [x for x in (captured.out + captured.err).splitlines() if str(train) in x]
    assert len(said) == 1 and f"none of its 60 lines is a usable record" in said[0], said
