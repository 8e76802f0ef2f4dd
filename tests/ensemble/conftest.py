import sys
from pathlib import Path

# The shared check of the ensemble tests (loop_reference.py) is a plain module of this folder,
# for the tests in kernels/ too.
sys.path.insert(0, str(Path(__file__).parent))
