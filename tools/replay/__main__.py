"""``python -m tools.replay``."""
import sys

from tools.replay.cli import main

sys.exit(main())
