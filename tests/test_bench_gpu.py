"""`python -m tools.bench gpu` on the CPU: every probe runs tiny, as it would on a GPU, so it cannot rot.

The Megatron probes need megatron-core's CUDA calls mapped to the CPU, which only the test suite does
(tests/megatron_cpu_shim.py): they run in a child process with the shim installed; run plainly on the CPU
they say they were skipped and why.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from actors.engines import megatron
from tools.bench import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import sys
    from tests import megatron_cpu_shim
    megatron_cpu_shim.install()
    from tools.bench import gpu
    sys.exit(gpu.main(["--out", sys.argv[1]], megatron_on_cpu=True))
""")


@pytest.mark.skipif(not megatron.is_available(), reason=f"megatron-core not importable ({megatron.MEGATRON_IMPORT_ERROR})")
def test_every_probe_runs_tiny_on_the_cpu_and_writes_json(tmp_path) -> None:
    out = tmp_path / "probes.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    for name in gpu.PROBES:
        assert "error" not in result[name] and "skipped" not in result[name], (name, result[name])
    lengths = [str(n) for n in result["sizes"]["attention_lengths"]]
    assert all("seconds" in result["attention"][n]["sdpa_flash"] for n in lengths)   # the CPU flash kernel takes it
    assert result["megatron"]["plan_gib_without_reserve"] > 0 and result["megatron"]["loss"] > 0
    assert result["publish"]["buckets"] > 1 and result["publish"]["bytes"] > 0
    assert result["overlap"]["push_stream"]["pushed_gb_per_s"] > 0
    assert result["broadcast"]["bucket_ratio"] > 0 and result["decode"]["eager_step_ms"] > 0
    moe = result["moe"]
    assert moe["train_native"]["tokens_per_s"] > 0 and moe["train_replayed"]["tokens_per_s"] > 0
    assert moe["decode"]["step_ms_capturing"] > 0 and moe["active_params"] < moe["params"]


def test_without_the_shim_the_megatron_probes_say_why_they_were_skipped(tmp_path, capsys) -> None:
    out = tmp_path / "probes.json"
    assert gpu.main(["--only", "attention,megatron", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "skipped" in result["megatron"] and "CUDA" in result["megatron"]["skipped"]
    assert "error" not in result["attention"]
    with pytest.raises(SystemExit):
        gpu.main(["--only", "attention,bogus"])
