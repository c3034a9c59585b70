"""tools.filter_data: on a tiny model that memorised the level-1 prompts, the prompts it answers right n times
out of n are dropped (the same verdicts as tools.eval's), the kept lines are the input's own, an interrupted
filter continues where it stopped and writes what an uninterrupted one does, and misuse is a clear error."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.evaluator import harness
from tools import filter_data as fd
from test_sft import train_tiny_model

N, MAX_NEW = 4, 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return train_tiny_model(tmp_path_factory.mktemp("filter"))


def run(trained: dict[str, Path], out: Path, **kw) -> dict:
    kw = {"n": N, "max_new_tokens": MAX_NEW, "chunk": 8, "progress": False, **kw}
    return fd.filter_data(str(trained["ckpt"]), str(trained["data"]), str(out), **kw)


def input_lines(trained: dict[str, Path]) -> dict[str, str]:
    return {json.loads(line)["query_id"]: line for line in trained["data"].read_text().splitlines() if line.strip()}


def test_prompts_solved_every_time_are_dropped_as_tools_eval_grades_them(trained, tmp_path):
    out = tmp_path / "kept.jsonl"
    # one chunk starting at 0 samples with tools.eval's seeds, so the verdicts can be compared one by one
    summary = run(trained, out, chunk=1000)
    report = harness.evaluate(str(trained["ckpt"]), str(trained["data"]), k=N, samples=N, greedy=False,
                         max_new_tokens=MAX_NEW, details=True)
    expect_kept = [r["query_id"] for r in report["prompts"] if not all(r["sample_correct"])]
    lines = out.read_text().splitlines()
    assert [json.loads(line)["query_id"] for line in lines] == expect_kept
    assert 0 < len(expect_kept) < report["n_prompts"], "the model should solve some prompts every time, not all"
    original = input_lines(trained)
    assert lines == [original[q] for q in expect_kept]          # the input's own lines, unchanged
    assert summary["kept"] == len(expect_kept) and summary["prompts"] == report["n_prompts"]
    assert summary["dropped_all_correct"] == report["n_prompts"] - len(expect_kept)
    assert sum(c["prompts"] for c in summary["by_level"].values()) == report["n_prompts"]
    # the memorised level 1 loses prompts, the unsolved level 2 keeps them all
    assert summary["by_level"]["1"]["kept"] < summary["by_level"]["1"]["prompts"]
    assert summary["by_level"]["2"]["kept"] == summary["by_level"]["2"]["prompts"]


class Interrupted(Exception):
    pass


def test_an_interrupted_filter_continues_and_writes_what_an_uninterrupted_one_does(trained, tmp_path, monkeypatch):
    whole = tmp_path / "whole.jsonl"
    run(trained, whole)
    out = tmp_path / "resumed.jsonl"
    real = fd.aevaluate_with
    calls: list[list[str]] = []

    async def stops_at_third_chunk(generate, tokenizer, records, settings, pool=None, details=False):
        if len(calls) == 2:
            raise Interrupted()
        calls.append([r.query_id for r in records])
        return await real(generate, tokenizer, records, settings, pool, details)

    monkeypatch.setattr(fd, "aevaluate_with", stops_at_third_chunk)
    with pytest.raises(Interrupted):
        run(trained, out)
    state = json.loads(fd.progress_path(out).read_text())
    assert state["done"] == 16 and not state["complete"]
    with open(out, "a") as f:   # a chunk written whose progress was never recorded (killed in between)
        f.write('{"query_id": "half-written", "prom')

    resumed: list[str] = []

    async def counting(generate, tokenizer, records, settings, pool=None, details=False):
        resumed.extend(r.query_id for r in records)
        return await real(generate, tokenizer, records, settings, pool, details)

    monkeypatch.setattr(fd, "aevaluate_with", counting)
    summary = run(trained, out)
    ids = list(input_lines(trained))
    assert resumed == ids[16:]                                   # the first two chunks were not done again
    assert out.read_bytes() == whole.read_bytes()
    assert json.loads(fd.progress_path(out).read_text())["complete"]

    # A finished filter is not redone.
    monkeypatch.setattr(fd, "aevaluate_with", None)
    again = run(trained, out)
    assert (again["kept"], again["prompts"]) == (summary["kept"], summary["prompts"])
    assert out.read_bytes() == whole.read_bytes()


def test_misuse_is_a_clear_error(trained, tmp_path, capsys):
    out = tmp_path / "kept.jsonl"
    run(trained, out, chunk=1000)
    with pytest.raises(fd.FilterError, match=r"n=4.*this run has 2"):
        run(trained, out, n=2, chunk=1000)
    other = tmp_path / "someone_elses.jsonl"
    other.write_text('{"x": 1}\n')
    with pytest.raises(fd.FilterError, match="no someone_elses.jsonl.progress.json"):
        run(trained, other)
    assert other.read_text() == '{"x": 1}\n'                     # left alone

    length = ["--max-new-tokens", str(MAX_NEW)]
    assert fd.main([str(trained["init"]), "--data", str(trained["data"]), "--out", str(tmp_path / "a.jsonl"),
                    *length]) == 2
    assert "no model weights" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(trained["data"].read_text().splitlines()[0] + "\n{not json\n")
    assert fd.main([str(trained["ckpt"]), "--data", str(bad), "--out", str(tmp_path / "b.jsonl"), *length]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_command_line_summary_and_progress_bar(trained, tmp_path, capsys):
    out = tmp_path / "kept.jsonl"
    code = fd.main([str(trained["ckpt"]), "--data", str(trained["data"]), "--out", str(out), "--n", str(N),
                    "--max-new-tokens", str(MAX_NEW), "--chunk", "10", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    summary = json.loads(captured.out)
    assert summary["kept"] == len(out.read_text().splitlines()) and summary["prompts"] == 38
    assert "38/38" in captured.err                                 # the bar reached the end, on stderr


def test_the_length_comes_from_the_recipe_and_answers_cut_short_stop_the_filter(trained, tmp_path, capsys):
    # No recipe and no length: refused, rather than answers cut at some default length.
    with pytest.raises(SystemExit):
        fd.main([str(trained["ckpt"]), "--data", str(trained["data"]), "--out", str(tmp_path / "a.jsonl")])
    assert "give --config (the recipe" in capsys.readouterr().err
    # The recipe's gen.max_new_tokens, temperature and top_p are the filter's.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"gen: {{max_new_tokens: {MAX_NEW}, temperature: 1.0, top_p: 1.0}}\n")
    out = tmp_path / "recipe.jsonl"
    assert fd.main([str(trained["ckpt"]), "--data", str(trained["data"]), "--out", str(out), "--config", str(recipe),
                    "--n", str(N), "--chunk", "8", "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["max_new_tokens"] == MAX_NEW and summary["answers_cut"] < 0.5
    assert out.read_bytes() == (run(trained, tmp_path / "same.jsonl"), (tmp_path / "same.jsonl").read_bytes())[1]
    # Answers mostly cut at the limit: the filter stops before writing any of that chunk.
    cut = tmp_path / "cut.jsonl"
    with pytest.raises(fd.FilterError, match=r"were cut at max_new_tokens 2 \(more than --max-cut 0.5\)"):
        run(trained, cut, max_new_tokens=2)
    assert not cut.exists() or cut.read_text() == ""


def test_sglang_servers_filter_as_the_embedded_engine(trained, tmp_path):
    # The filter through an SGLang server started on the model (the stand-in as its command) writes what it writes
    # through a running server on the same weights: the SGLang engine seeds each sample itself
    # (actors/engines/sglang.py), so its samples are not the embedded engine's, but they are the same on any server.
    import sys

    from actors.engines.checkpoint import load_model
    from actors.engines.torch_gen import TorchGenerationEngine
    from testsupport.sglang_standin import StandinThread

    launched = run(trained, tmp_path / "launched.jsonl", engine="sglang", servers=1, n=1,
                   server_command=[sys.executable, "-m", "testsupport.sglang_standin"])
    server = StandinThread(TorchGenerationEngine(model=load_model(str(trained["ckpt"])))).start()
    try:
        attached = run(trained, tmp_path / "attached.jsonl", engine="sglang", url=server.url, n=1)
    finally:
        server.stop()
    assert server.server.counters["generate"] == 38
    assert (tmp_path / "launched.jsonl").read_bytes() == (tmp_path / "attached.jsonl").read_bytes()
    assert launched["kept"] == attached["kept"] and 0 < launched["kept"] < 38
