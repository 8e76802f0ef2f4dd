"""``python benchmarks/report [--quick] [--out DIR] [-k EXPR] [--wide] [--page FILE] [--from JSON]``."""

import sys
from pathlib import Path

# Run as a folder, the folder itself stands first on sys.path; its parent holds the package.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from report.cli import main  # noqa: E402

raise SystemExit(main())
