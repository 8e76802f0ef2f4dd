import sys
from pathlib import Path

# The zoo (tests/zoo.py) is shared by the test files as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
