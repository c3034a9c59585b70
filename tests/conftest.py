import os
import sys
from pathlib import Path

# Keep compiled modules even where PYTHONDONTWRITEBYTECODE is set (CI images set it): the suite starts
# hundreds of Python processes, each of which would otherwise compile every module of ours it imports, and
# each worker would compile every test module it rewrites (collecting alone: 25.5 s of CPU without the cache,
# 15.3 s with it, `python -m pytest --collect-only -q` on a 2-core machine). The processes tests start read
# the cache these write.
sys.dont_write_bytecode = False

# Tests run on 2-core machines next to each other: keep torch from oversubscribing cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests must be reproducible and must not fail because a loaded CI machine is slow:
# derandomize fixes each test's examples, and no per-example wall-clock deadline.
settings.register_profile("project", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("project")


def pytest_unconfigure(config: object) -> None:
    # Anything still hanging once the session has reported (a thread or a ZeroMQ context waiting at
    # exit) must fail the run with every thread's stack, not hold CI until its time limit.
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)


@pytest.fixture
def random_model_dir(tmp_path: Path) -> Path:
    """A tiny random Qwen2 (seed 0) with the shipped arith tokenizer, in Hugging Face layout, that actors load."""
    from testsupport.tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path / "model")


@pytest.fixture
def standin(request):
    """An SGLang stand-in server (testsupport/sglang_standin.py) in a thread, over a tiny random model (seed 0),
    serving as the newest supported SGLang release, or as the one a test names by indirect parametrization
    (``@pytest.mark.parametrize("standin", SGLANG_VERSIONS, indirect=True)``)."""
    from actors.engines.sglang_routes import SGLANG_VERSION
    from actors.engines.torch_gen import TorchGenerationEngine
    from testsupport.sglang_standin import StandinThread
    from testsupport.tiny_models import tiny_model

    release = getattr(request, "param", SGLANG_VERSION)
    server = StandinThread(TorchGenerationEngine(model=tiny_model(seed=0)), release=release).start()
    yield server
    server.stop()


@pytest.fixture
def careful_agent():
    """A script for testsupport.scripted_engine: the model that solves the agent task's calculator chains as its
    careful teacher does (launch/prepare/agent_task.py), one turn per call, with the shipped arith tokenizer."""
    from actors.engines.tokenizer import load_tokenizer
    from testsupport.tiny_models import ARITH_TOKENIZER_DIR
    from launch.prepare.agent_task import PROMPT_TEMPLATE, Chain, tool_transcript

    tokenizer = load_tokenizer(str(ARITH_TOKENIZER_DIR))
    prefix = PROMPT_TEMPLATE.split("{")[0]

    def script(context, sample):
        text = tokenizer.decode(context)
        prompt, _, answered = text.partition("\n")
        turns = [s["text"] for s in tool_transcript(Chain.parse(prompt.removeprefix(prefix))) if s["role"] == "model"]
        k = answered.count("=")   # observations so far
        return tokenizer.encode(turns[k]) + ([tokenizer.eos_token_id] if k == len(turns) - 1 else [])
    return script
