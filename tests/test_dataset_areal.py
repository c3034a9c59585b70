"""The loaders on small samples of AReaL's released data, written in the layouts the real files have.

tests/data/areal/ holds a few lines of each, our own problems in AReaL's fields. Where each layout comes from
(AReaL's repository, inclusionAI/AReaL, at the tags named):

* boba_106k_0319.jsonl, orz-zero_56k_0319.jsonl (the tutorial's downloads, v0.2.0 examples/README.md): one
  JSON object a line with ``prompt``, ``query_id``, ``task`` ("math") and ``solutions`` (a list of strings):
  realhf/impl/dataset/math_code_dataset.py, ``check_math_metadata_entries`` (v0.2.0). The prompt is used as it
  is (the same file tokenizes ``x["prompt"]`` with no template), so it carries its template: for boba the
  DeepSeek-R1 turn, whose markers v0.3.4's examples/math/boba_grpo.py strips (``<｜User｜>``,
  ``<｜Assistant｜>``, ``<think>``); for orz-zero Open-Reasoner-Zero's (evaluation/utils.py "orz", v0.2.0).
  Several solutions to one problem, the first boxing a choice letter and the second the value, are the
  example of realhf/impl/dataset/math_parser.py's ``__main__`` (v0.2.0).
* prompts_for_r1_distilled.jsonl, prompts_for_zero.jsonl + id2info.json (v0.1.1 and v0.2.0
  examples/env/scripts/download-dataset.sh; the zero prompts carry Open-Reasoner-Zero's template): "each
  entry containing two keys: prompt ... and query_id" (v0.1.1 examples/README.md, "How to train with other
  datasets"), tokenized as they are (realhf/impl/dataset/prompt_dataset.py, MATHPromptDataset); the answers
  in a JSON object {query_id: {"solutions": [...]}} (realhf/impl/model/interface/math_parser.py, loadJson
  and ``id2info[query_id]["solutions"]``).
* eval/<name>/test.jsonl: evaluation/data/{aime24,aime25,amc23,math_500}/test.jsonl (v0.2.0), field for field
  (aime24: id, problem, solution, answer as a string, url, question; aime25: problem, answer as an integer,
  id; amc23: id, problem, answer as a float, url, question; math_500: problem, solution, answer, subject,
  level, unique_id).

The wget downloads of the tutorial save ``NAME?download=true``: the loader finds them under NAME.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from actors.dataset import (DOWNLOAD_SUFFIX, LAYOUTS, DatasetError, Layout, load_dataset, load_id2info,
                            resolve_data_path, solution_answer)
from actors.reward.math_grader import grade_math
from topology.experiment import PROMPT_TEMPLATES

AREAL_DATA = Path(__file__).resolve().parent / "data" / "areal"


def downloaded(tmp_path: Path, name: str) -> Path:
    """The fixture saved as the tutorial's wget saves it (NAME?download=true); returns the bare NAME."""
    shutil.copy(AREAL_DATA / name, tmp_path / (name + DOWNLOAD_SUFFIX))
    return tmp_path / name


def test_boba_is_found_under_its_download_name_and_every_solution_is_an_answer(tmp_path):
    bare = downloaded(tmp_path, "boba_106k_0319.jsonl")
    assert not bare.exists() and resolve_data_path(bare).name == "boba_106k_0319.jsonl?download=true"
    ds = load_dataset(bare)
    assert ds.path.endswith(DOWNLOAD_SUFFIX) and len(ds) == 3
    first = ds[0]
    assert first.query_id == "fe11b471-1aa9-4867-958f-a0a811c85f92" and first.extra == {"task": "math"}
    assert first.answers == ("A", "-\\frac{2}{3}") and first.answer == "A"
    # A response matching the second solution is right, as AReaL's reward grades it (any solution matches).
    response = "... so the difference is \\boxed{-\\frac{2}{3}}"
    assert grade_math(response, list(first.references)).correct
    assert not grade_math(response, first.answer).correct
    assert ds[2].answers == ("4", "x=4")
    # Evaluation grades the same way (tools.eval, the evaluator, tools.filter_data).
    from actors.evaluator.evaluation import grade_records
    verdicts = grade_records([response, "\\boxed{A}", "\\boxed{B}"], [first] * 3)
    assert [v.correct for v in verdicts] == [True, True, False]
    # The prompts carry the R1 turn already: a configured template is not wrapped around them again.
    layout = Layout.from_settings({"prompt_template": "boba"})
    again = load_dataset(bare, layout=layout)
    assert [r.prompt for r in again] == [r.prompt for r in ds] and again.templated_as_is == 3
    assert ds[1].prompt.count("<｜Assistant｜>") == 1


def test_a_missing_file_names_both_spellings(tmp_path):
    with pytest.raises(DatasetError, match=r"no such file, nor boba_106k_0319.jsonl\?download=true"):
        load_dataset(tmp_path / "boba_106k_0319.jsonl")


def test_orz_prompts_keep_their_own_template_under_a_zero_style_one():
    # The R1-Zero template a recipe might set: its "Assistant: <think>" tail is in every ORZ prompt already.
    r1_zero = ("A conversation between User and Assistant. ... within \\boxed{}.\nUser: {prompt}\nAssistant: <think>")
    ds = load_dataset(AREAL_DATA / "orz-zero_56k_0319.jsonl", layout=Layout.from_settings({"prompt_template": r1_zero}))
    assert ds.templated_as_is == 2
    assert all(r.prompt.startswith("A conversation between User and Assistant.") and
               r.prompt.count("Assistant: <think>") == 1 for r in ds)
    assert [r.answer for r in ds] == ["56", "2"]
    # A bare question still gets the template.
    plain = Layout.from_settings({"prompt_template": "orz"})
    assert plain.prompt_template == PROMPT_TEMPLATES["orz"]


def test_v01_prompts_with_id2info_and_solutions_without_a_box(tmp_path):
    prompts = downloaded(tmp_path, "prompts_for_r1_distilled.jsonl")
    info = downloaded(tmp_path, "id2info.json")
    assert {"deepscaler-0", "deepscaler-1", "deepscaler-2"} <= set(load_id2info(info))
    ds = load_dataset(prompts, layout=Layout.from_settings({"id2info": str(info)}))
    by_id = {r.query_id: r for r in ds}
    assert by_id["deepscaler-0"].answers == ("55",)
    # No \boxed{} in the solution: its last number, as AReaL's extract_answer(solution, use_last_number=True).
    assert by_id["deepscaler-1"].answers == ("40",)
    # "The answer is 81." is read as AReaL reads it; the boxed second solution gives the same answer once.
    assert by_id["deepscaler-2"].answers == ("81",)
    assert grade_math("the speed is \\boxed{40}", list(by_id["deepscaler-1"].references)).correct


@pytest.mark.parametrize("text,want", [
    ("so \\boxed{\\frac{1}{2}} and \\boxed{3}", "3"),
    ("We get 12 apples. The answer is 12.", "12"),
    ("Thus the final answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
    ("It costs 1,250 dollars, or 1.25 thousand.", "1.25"),
    ("-3 is less than 4", "4"),
    ("no numbers here", None),
])
def test_solution_answer_reads_a_solution_as_areal_does(text, want):
    assert solution_answer(text) == want


def test_areal_evaluation_files_read_in_their_layout():
    layout = LAYOUTS["areal_eval"]
    got = {}
    for name in ("aime24", "aime25", "amc23", "math_500"):
        ds = load_dataset(AREAL_DATA / "eval" / name / "test.jsonl", layout=layout)
        got[name] = [(r.query_id, r.answer, r.level) for r in ds]
        assert all(r.prompt and "{prompt}" not in r.prompt for r in ds)
    assert got["aime24"] == [("1", "204", None)]
    assert got["aime25"] == [("1", "10", None)]
    assert got["amc23"] == [("1", "27.0", None)]
    assert got["math_500"] == [("1", "\\left( 3, \\frac{\\pi}{2} \\right)", 2), ("2", "\\frac{5}{6}", 1)]
    # the question field wins where both exist (AReaL's parse_question order), the problem where it is alone
    aime25 = load_dataset(AREAL_DATA / "eval" / "aime25" / "test.jsonl", layout=layout)[0]
    assert aime25.prompt.startswith("Find the sum") and aime25.extra == {"id": "0"}
    assert grade_math("\\boxed{27}", load_dataset(AREAL_DATA / "eval" / "amc23" / "test.jsonl",
                                                   layout=layout)[0].answer).correct


def test_an_evaluation_line_without_any_prompt_field_names_them_all(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"answer": "3", "text": "1+2?"}) + "\n")
    with pytest.raises(DatasetError, match=r"field 'question': missing \(nor 'problem', 'Question', 'input'\)"):
        load_dataset(path, layout=LAYOUTS["areal_eval"])


def test_test_layout_applies_to_the_held_out_file_only():
    data = {"layout": "areal", "id2info": "/x/id2info.json", "test_layout": "areal_eval",
            "prompt_template": "r1-distilled-qwen"}
    train, test = Layout.from_settings(data), Layout.from_settings(data, test=True)
    assert (train.prompt, train.id2info) == ("prompt", "/x/id2info.json")
    assert (test.prompt, test.id2info, test.prompt_fallbacks) == ("question", None, ("problem", "Question", "input"))
    assert test.prompt_template == train.prompt_template == PROMPT_TEMPLATES["r1-distilled-qwen"]
    same = Layout.from_settings({"layout": "math"}, test=True)
    assert same == LAYOUTS["math"]


def test_prompts_over_the_cap_are_left_out_not_cut():
    from actors.dataset import within_prompt_cap
    ids = [[1] * 5, [1] * 9, [1] * 8, []]
    assert within_prompt_cap(ids, 8) == [0, 2, 3]
    assert within_prompt_cap(ids, None) == [0, 1, 2, 3]
