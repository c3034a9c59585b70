"""Test doubles and test helpers that run as real code: the SGLang stand-in server, the demo pinger/echoer
actors (with their crash hooks), small random Qwen2 models, bounded waits and specs for local actors.

They sit beside the product, not inside it: nothing in ``actors``, ``transport`` or ``algo`` imports them.
The import direction is ``tests, tools -> testsupport -> actors -> (transport, algo)``: the tests use them,
the launcher starts the demo actors by their class path (``topology/demo_*.yaml``), and the engine
benchmark (``tools/bench/gpu.py``) builds its model with ``tiny_models``. The package is installed with the
others so that those entry points work from an installed copy too.
"""
