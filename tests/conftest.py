import os

# Tests run on 2-core machines next to each other: keep torch from oversubscribing cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
