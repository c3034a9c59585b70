"""tools.eval: greedy accuracy, pass@k, maj@k and lengths agree with a hand-computed reference (plain
forward-pass greedy decoding, a regex grader, math.comb pass@k) on a model trained to answer some prompts."""
from __future__ import annotations

import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from actors.dataset import DatasetError, load_dataset
from actors.engines.checkpoint import load_model
from actors.engines.tokenizer import load_tokenizer
from actors.evaluator import harness
from tools import eval as ev
from test_sft import train_tiny_model

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return train_tiny_model(tmp_path_factory.mktemp("eval"))


def reference_greedy(model_dir: Path, prompts: list[str], max_new: int) -> list[tuple[str, int, bool]]:
    """(text, answer length, stopped) per prompt: full forward pass per token, argmax, no KV cache."""
    model, tok = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    eos = tok.eos_token_id
    out = []
    for prompt in prompts:
        ids = tok.encode(prompt)
        new: list[int] = []
        with torch.no_grad():
            for _ in range(max_new):
                nxt = int(model(torch.tensor([ids + new]))[0, -1].argmax())
                if nxt == eos:
                    break
                new.append(nxt)
        out.append((tok.decode(new), len(new), len(new) < max_new))
    return out


def boxed_correct(text: str, answer: str) -> bool:
    """The last boxed integer equals the answer (as numbers: the grader accepts "04" for 4)."""
    found = BOXED.findall(text)
    if not found:
        return False
    try:
        return int(found[-1].strip()) == int(answer)
    except ValueError:
        return found[-1].strip() == answer


def comb_pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_evaluate_agrees_with_a_hand_computed_reference(trained):
    report = harness.evaluate(str(trained["ckpt"]), str(trained["data"]), k=4, samples=8, max_new_tokens=16, details=True)
    records = load_dataset(trained["data"]).records
    assert report["n_prompts"] == len(records) == 38 and report["samples"] == 8 and report["skipped_lines"] == 0
    rows = report["prompts"]
    assert [r["query_id"] for r in rows] == [r.query_id for r in records]

    # Greedy: the engine's batched, KV-cached decoding equals plain argmax decoding, answer by answer.
    ref = reference_greedy(trained["ckpt"], [r.prompt for r in records], 16)
    by_level: dict[str, list[bool]] = defaultdict(list)
    for rec, row, (text, length, stopped) in zip(records, rows, ref):
        assert row["greedy_response"] == text
        assert row["greedy_len"] == length and row["greedy_truncated"] == (not stopped)
        assert row["greedy_correct"] == boxed_correct(text, rec.answer)
        by_level[str(rec.level)].append(boxed_correct(text, rec.answer))
    for level, flags in by_level.items():
        assert report["by_level"][level]["greedy_accuracy"] == pytest.approx(sum(flags) / len(flags))
    all_flags = [f for flags in by_level.values() for f in flags]
    assert report["overall"]["greedy_accuracy"] == pytest.approx(sum(all_flags) / len(all_flags))
    assert report["by_level"]["1"]["greedy_accuracy"] > 0.5 and report["by_level"]["2"]["greedy_accuracy"] == 0.0

    # Sampled: each recorded answer graded by hand; pass@k from math.comb; maj@k by counting votes.
    for rec, row in zip(records, rows):
        assert row["sample_correct"] == [boxed_correct(t, rec.answer) for t in row["sample_responses"]]
    for level in ("1", "2"):
        mine = [r for r in rows if r["level"] == level]
        counts = [(len(r["sample_correct"]), sum(r["sample_correct"])) for r in mine]
        summary = report["by_level"][level]
        assert summary["pass@1"] == pytest.approx(sum(c / n for n, c in counts) / len(counts))
        assert summary["pass@4"] == pytest.approx(sum(comb_pass_at_k(n, c, 4) for n, c in counts) / len(counts))
        majority = 0
        for r in mine:
            votes = [a for a in r["sample_answers"][:4] if a is not None]
            if votes:
                top = max(votes.count(a) for a in votes)
                winner = next(j for j, a in enumerate(r["sample_answers"][:4]) if a is not None and votes.count(a) == top)
                majority += r["sample_correct"][winner]
        assert summary["maj@4"] == pytest.approx(majority / len(mine))
        lens = [x for r in mine for x in r["sample_lens"]]
        assert summary["sample_len"] == pytest.approx(sum(lens) / len(lens))
    level1 = report["by_level"]["1"]
    assert 0 < level1["pass@1"] <= level1["pass@4"] <= 1.0

    # Seeded sampling: the same call gives the same answers.
    again = harness.evaluate(str(trained["ckpt"]), str(trained["data"]), k=4, samples=8, max_new_tokens=16, details=True)
    assert [r["sample_responses"] for r in again["prompts"]] == [r["sample_responses"] for r in rows]


def test_cli_json_table_and_errors(trained, tmp_path, capsys):
    assert ev.main([str(trained["ckpt"]), "--data", str(trained["data"]), "--protocol", "plain", "--k", "2", "--samples", "2",
                    "--max-new-tokens", "16", "--levels", "1", "--max-per-level", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n_prompts"] == 5 and list(report["by_level"]) == ["1"] and "pass@2" in report["overall"]
    assert ev.main([str(trained["ckpt"]), "--data", str(trained["data"]), "--protocol", "plain", "--samples", "0",
                    "--max-new-tokens", "16", "--max-per-level", "3"]) == 0
    table = capsys.readouterr().out
    assert "greedy %" in table and "all" in table

    assert ev.main([str(tmp_path), "--data", str(trained["data"]), "--protocol", "plain"]) == 2
    assert "no model weights" in capsys.readouterr().err
    assert ev.main([str(trained["ckpt"]), "--data", str(trained["data"]), "--protocol", "plain", "--k", "8", "--samples", "4"]) == 2
    assert "samples (4) must be at least k (8)" in capsys.readouterr().err

    bad = tmp_path / "bad.jsonl"
    lines = trained["data"].read_text().splitlines()
    bad.write_text("\n".join(lines[:2] + ['{"query_id": "q", "prompt": "Compute: 1+1\\n"}'] + lines[2:5]) + "\n")
    assert ev.main([str(trained["ckpt"]), "--data", str(bad), "--protocol", "plain", "--samples", "0"]) == 2
    assert f"{bad}:3: field 'answer': missing" in capsys.readouterr().err
    with pytest.raises(DatasetError, match=r"bad.jsonl:3"):
        harness.evaluate(str(trained["ckpt"]), str(bad), samples=0)
    report = harness.evaluate(str(trained["ckpt"]), str(bad), samples=0, max_new_tokens=16, on_error="skip")
    assert report["skipped_lines"] == 1 and report["n_prompts"] == 5


def test_cli_seeds_protocol_top_p_more_pass_k_config_and_tutorial_table(trained, tmp_path, capsys):
    config = tmp_path / "exp.yaml"
    config.write_text("gen: {max_new_tokens: 12}\ndata: {layout: areal}\n")
    args = [str(trained["ckpt"]), "--data", str(trained["data"]), "--protocol", "plain", "--k", "2", "--samples", "4",
            "--pass-k", "4", "--top-p", "0.95", "--temperature", "0.6", "--max-per-level", "3", "--config", str(config)]
    assert ev.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["max_new_tokens"], report["top_p"], report["pass_ks"]) == (12, 0.95, [2, 4])
    overall = report["overall"]
    assert overall["pass@1"] <= overall["pass@2"] <= overall["pass@4"]
    # top-p changes what is sampled (same seeds)
    full = harness.evaluate(str(trained["ckpt"]), str(trained["data"]), k=2, samples=4, temperature=0.6, top_p=1.0,
                       max_new_tokens=12, max_per_level=3, details=True)
    nucleus = harness.evaluate(str(trained["ckpt"]), str(trained["data"]), k=2, samples=4, temperature=0.6, top_p=0.05,
                          max_new_tokens=12, max_per_level=3, details=True)
    assert [r["sample_responses"] for r in full["prompts"]] != [r["sample_responses"] for r in nucleus["prompts"]]

    assert ev.main([*args, "--table", "tutorial"]) == 0
    table = capsys.readouterr().out
    for column in ("dataset", "num_questions", "greedy_length", "sample_length", "greedy_acc", "sample_pass@1",
                   "pass@2", "pass@4"):
        assert column in table, column
    assert "train" in table and f"{100 * overall['pass@4']:.1f}" in table

    assert ev.main([*args, "--top-p", "0"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert ev.main([*args, "--pass-k", "8"]) == 2
    assert "pass@8 needs 1 <= k <= samples (4)" in capsys.readouterr().err


def test_sglang_engine_gives_the_embedded_engines_report(trained, tmp_path, capsys):
    # The stand-in server (the SGLang engine tests' server) serves the trained checkpoint over /generate.
    import urllib.request

    from testsupport.sglang_standin import StandinThread
    from actors.engines.torch_gen import TorchGenerationEngine

    kwargs = dict(k=4, samples=8, max_new_tokens=16, details=True)
    local = harness.evaluate(str(trained["ckpt"]), str(trained["data"]), **kwargs)
    server = StandinThread(TorchGenerationEngine(model=load_model(str(trained["ckpt"]))), weight_version="7").start()
    try:
        # only the tokenizer is needed here: the server holds the weights
        tok_dir = tmp_path / "tok"
        tok_dir.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            (tok_dir / name).write_bytes((trained["ckpt"] / name).read_bytes())
        remote = harness.evaluate(str(tok_dir), str(trained["data"]), engine="sglang", url=server.url, **kwargs)
        with urllib.request.urlopen(server.url + "/model_info", timeout=30) as r:
            label = json.loads(r.read())["weight_version"]
        assert ev.main([str(tok_dir), "--data", str(trained["data"]), "--protocol", "plain", "--engine", "sglang",
                        "--url", server.url,
                        "--k", "4", "--max-new-tokens", "16", "--json"]) == 0
        cli = json.loads(capsys.readouterr().out)
    finally:
        server.stop()
    # every answer of both evaluations went through the server: greedy + 8 samples, then greedy + 4 (--k 4)
    assert server.server.counters["generate"] == 38 * (1 + 8) + 38 * (1 + 4)
    assert remote["engine"] == f"sglang {server.url}" and local["engine"] == "torch cpu"
    # Greedy answers are the same model's argmax either way. Sampled ones differ: the SGLang engine seeds each
    # of a prompt's n samples as a request of its own (actors/engines/sglang.py, _sample_seed).
    greedy_keys = ("n", "greedy_accuracy", "greedy_len", "greedy_truncated")
    for name, summary in [("all", local["overall"]), *local["by_level"].items()]:
        other = remote["overall"] if name == "all" else remote["by_level"][name]
        assert {k: other[k] for k in greedy_keys} == {k: summary[k] for k in greedy_keys}, name
    assert [len(r["sample_correct"]) for r in remote["prompts"]] == [8] * 38
    assert remote["overall"]["pass@1"] == pytest.approx(sum(map(sum, (r["sample_correct"] for r in remote["prompts"])))
                                                        / (8 * 38))
    assert [r["greedy_response"] for r in remote["prompts"]] == [r["greedy_response"] for r in local["prompts"]]
    assert 0 < local["overall"]["greedy_accuracy"] < 1
    assert label == "7"                      # an evaluation reads the server's label, it does not change it
    assert cli["overall"]["greedy_accuracy"] == local["overall"]["greedy_accuracy"]

    # without --url the servers are started on CHECKPOINT, which then needs its weights
    assert ev.main([str(tok_dir), "--data", str(trained["data"]), "--protocol", "plain", "--engine", "sglang"]) == 2
    assert "tok: no model weights" in capsys.readouterr().err
    assert ev.main([str(trained["ckpt"]), "--data", str(trained["data"]), "--protocol", "plain", "--engine", "torch",
                    "--url", "http://127.0.0.1:1"]) == 2
    assert "--url is for --engine sglang" in capsys.readouterr().err


def short_context_model_dir(path: Path, positions: int = 320) -> Path:
    """A random tiny model with the arith tokenizer whose context ends at `positions`: answers stop there."""
    import shutil

    from actors.engines.checkpoint import save_model
    from testsupport.tiny_models import ARITH_TOKENIZER_DIR, ARITH_VOCAB, tiny_model

    save_model(tiny_model(3, vocab_size=ARITH_VOCAB, max_position_embeddings=positions), str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ARITH_TOKENIZER_DIR / name, path / name)
    return path


AREAL_EVAL = Path(__file__).resolve().parent / "data" / "areal" / "eval"


def test_no_flag_but_data_runs_the_tutorials_protocol_on_several_benchmarks(tmp_path, capsys, monkeypatch):
    # `python -m tools.eval CKPT --data a,b`: AReaL's evaluation layout and protocol with no other flag.
    model = short_context_model_dir(tmp_path / "model")
    seen: list = []
    real = harness.aevaluate_with

    async def spy(generate, tokenizer, records, settings, **kwargs):
        seen.append((records, settings))
        return await real(generate, tokenizer, records, settings, **kwargs)
    monkeypatch.setattr(harness, "aevaluate_with", spy)
    data = f"{AREAL_EVAL / 'math_500' / 'test.jsonl'},{AREAL_EVAL / 'amc23'}"
    assert ev.main([str(model), "--data", data]) == 0
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if "num_questions" in line)
    columns = [c.strip() for c in header.strip("┃| ").replace("┃", "|").split("|")]
    assert columns == ["dataset", "num_questions", "greedy_length", "sample_length", "greedy_acc", "sample_pass@1",
                       "pass@8", "pass@16"]
    rows = [line for line in table.splitlines() if "math_500" in line or "amc23" in line]
    assert len(rows) == 2 and " 2 " in rows[0] and " 1 " in rows[1]
    assert "32 samples at temperature 0.6, top-p 0.95, up to 32768 new tokens" in " ".join(table.split())
    # the protocol's settings and the R1 prompt around each question, the answer starting after "<think>\n"
    assert len(seen) == 2
    for records, settings in seen:
        assert (settings.samples, settings.temperature, settings.top_p, settings.max_new_tokens, settings.greedy) == \
            (32, 0.6, 0.95, 32768, True)
        assert sorted({settings.k, *settings.pass_ks}) == [8, 16]
        for rec in records:
            assert rec.prompt.startswith("<｜begin▁of▁sentence｜><｜User｜>") and \
                rec.prompt.endswith("within \\boxed{}.<｜Assistant｜><think>\n")
    assert seen[0][0][0].prompt.count("Convert the point") == 1

    # --json gives one report per benchmark, named as AReaL names them (the evaluation/data/<name>/ folder)
    assert ev.main([str(model), "--data", data, "--samples", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["dataset"] for r in out["datasets"]] == ["math_500", "amc23"]
    assert [r["n_prompts"] for r in out["datasets"]] == [2, 1] and out["datasets"][0]["pass_ks"] == [8, 16]


def test_bare_benchmark_names_are_read_under_data_dir(tmp_path):
    assert harness.resolve_benchmarks("aime24,math_500", str(AREAL_EVAL)) == \
        [str(AREAL_EVAL / "aime24" / "test.jsonl"), str(AREAL_EVAL / "math_500" / "test.jsonl")]
    assert harness.resolve_benchmarks(str(AREAL_EVAL / "aime25")) == [str(AREAL_EVAL / "aime25" / "test.jsonl")]
    assert harness.benchmark_name(AREAL_EVAL / "aime25" / "test.jsonl") == "aime25"
    assert harness.benchmark_name("/d/boba_106k_0319.jsonl?download=true") == "boba_106k_0319"
    with pytest.raises(ev.EvalError, match="no file given"):
        harness.resolve_benchmarks(" , ")


def test_started_sglang_servers_answer_as_the_embedded_engine(trained, tmp_path, capsys):
    # Two servers started on the checkpoint (the stand-in as the server command), the prompts spread over them:
    # greedy answers are the embedded engine's, benchmark by benchmark.
    test = trained["data"].parent / "test.jsonl"
    common = ["--protocol", "plain", "--samples", "0", "--max-new-tokens", "16", "--json"]
    data = f"{trained['data']},{test}"
    assert ev.main([str(trained["ckpt"]), "--data", data, "--engine", "torch", *common]) == 0
    local = json.loads(capsys.readouterr().out)["datasets"]
    assert ev.main([str(trained["ckpt"]), "--data", data, "--engine", "sglang", "--servers", "2",
                    "--server-command", f"{sys.executable} -m testsupport.sglang_standin", *common]) == 0
    remote = json.loads(capsys.readouterr().out)["datasets"]
    assert remote[0]["engine"].startswith("sglang 2 server(s)") and local[0]["engine"] == "torch cpu"
    for a, b in zip(local, remote):
        assert a["dataset"] == b["dataset"] and a["overall"] == b["overall"] and a["by_level"] == b["by_level"]


def test_the_default_device_and_engine_follow_the_machine(monkeypatch):
    import importlib.util

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (harness.default_device(), harness.default_engine()) == ("cpu", "torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert harness.default_device() == "cuda"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real(name, *a))
    assert harness.default_engine() == "sglang"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    assert harness.default_engine() == "torch"
