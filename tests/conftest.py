import sys
from pathlib import Path

from hypothesis import settings

# The zoo (tests/zoo.py) is shared by the test files as a plain module.
sys.path.insert(0, str(Path(__file__).parent))

# Timing varies a lot on shared 2-core machines: no per-example deadline, anywhere.
settings.register_profile("modstate", deadline=None)
settings.load_profile("modstate")
