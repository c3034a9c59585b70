"""tools.plot: PNGs from metrics.jsonl (+ eval.jsonl), notes for missing keys, clear errors for missing,
empty or malformed files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run: Path, rows: list[dict], name: str = plot.METRICS_FILE) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def full_rows(n: int = 6) -> list[dict]:
    return [{"step": i + 1, "time": 1_700_000_000.0 + 2.5 * i, "task_reward": -5 + i, "accuracy": 0.1 * i,
             "accuracy_by_level": {"1": 0.2 * i, "2": 0.05 * i}, "effective_throughput": 1000.0 + 10 * i,
             "staleness_mean": 0.5, "staleness_max": 2, "weight_sync_seconds": 0.01, "step_seconds": 2.5,
             "train_seconds": 2.0, "wait_seconds": 0.4, "weight_push_seconds": 0.15, "gen_stall_seconds": 0.002,
             "rollout_utilisation": 0.9} for i in range(n)]


def test_writes_every_plot(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, full_rows())
    write_metrics(run, [{"step": 3, "time": 1_700_000_005.0, "overall": {"greedy_accuracy": 0.3},
                         "by_level": {"1": {"greedy_accuracy": 0.5}}}], plot.EVAL_FILE)
    written, notes = plot.plot_run(run)
    assert sorted(p.name for p in written) == ["reward.png", "staleness.png", "throughput.png", "timing.png",
                                               "utilisation.png"]
    for path in written:
        assert path.parent == run / "plots" and path.read_bytes()[:8] == PNG_MAGIC
    assert notes == []
    assert plot.eval_accuracy({"overall": {"greedy_accuracy": 0.3}, "by_level": {"1": {"greedy_accuracy": 0.5}}}) \
        == (0.3, {"1": 0.5})
    assert plot.eval_accuracy({"accuracy": 0.4, "accuracy_by_level": {"2": 0.1}}) == (0.4, {"2": 0.1})


def test_missing_keys_are_skipped_with_a_note(tmp_path, capsys):
    run = tmp_path / "run"
    write_metrics(run, [{"step": i, "task_reward": float(i)} for i in range(1, 4)])
    assert plot.main([str(run), "--out", str(tmp_path / "png")]) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == [str(tmp_path / "png" / "reward.png")]
    for expected in ("no 'effective_throughput'", "no 'staleness_max'", "throughput.png: nothing to plot",
                     "metrics carry no 'time'", "eval.jsonl: absent"):
        assert expected in captured.err


def test_missing_empty_and_malformed_files_are_clear_errors(tmp_path, capsys):
    assert plot.main([str(tmp_path / "nope")]) == 2
    assert "nope: no such directory" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    assert plot.main([str(run)]) == 2
    assert f"{run / 'metrics.jsonl'}: no such file" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text("\n")
    with pytest.raises(plot.PlotError, match="metrics.jsonl: empty"):
        plot.plot_run(run)
    rows = [json.dumps(r) for r in full_rows(3)]
    (run / "metrics.jsonl").write_text("\n".join([rows[0], "{not json", rows[1]]) + "\n")
    with pytest.raises(plot.PlotError, match=r"metrics.jsonl:2: not valid JSON"):
        plot.plot_run(run)
    (run / "metrics.jsonl").write_text("\n".join([rows[0], "[1, 2]"]) + "\n")
    with pytest.raises(plot.PlotError, match=r"metrics.jsonl:2: expected a JSON object"):
        plot.plot_run(run)
    # A torn last line (a run still writing) is skipped with a note.
    (run / "metrics.jsonl").write_text("\n".join(rows[:2] + [rows[2][:20]]))
    written, notes = plot.plot_run(run, axis="step")
    assert len(written) == len(plot.PLOTS) and any("incomplete last line" in n for n in notes)
