"""The ``modstate`` command line: ``python -m modstate {demo,bench}``.

- ``demo`` (``_demo``): train an ensemble on an embedded synthetic task and show modstate at work;
  it runs from an installed wheel.
- ``bench``: the side-by-side benchmark report. Its harness lives next to the suites it runs, in
  a source checkout's ``benchmarks/report`` (the wheel ships neither); this command finds that
  checkout (the one modstate is imported from, else the current directory) and runs the harness
  there, and from a wheel it says in one line that it needs a checkout.

This part uses only modstate's public names.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import modstate

NEEDS_CHECKOUT = (
    "modstate bench needs a source checkout: the suites and their harness live in its "
    "benchmarks/ folder, which the installed package does not ship. Run it from a clone of the "
    "repository, after pip install -e '.[bench]'."
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``modstate``'s commands (``bench`` takes its own arguments, unparsed here).

    Returns:
        The ``argparse`` parser.
    """
    parser = argparse.ArgumentParser(
        prog="modstate",
        description="PyTorch model state as JAX-style pytrees.",
    )
    parser.add_argument("--version", action="version", version=f"modstate {modstate.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train and evaluate on an embedded synthetic dataset (the main job)",
        description="Train on an embedded synthetic regression task and show modstate at work.",
    )
    demo.add_argument("--members", type=_positive, default=8, help="ensemble members (default 8)")
    demo.add_argument("--steps", type=_positive, default=300, help="training steps (default 300)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    bench = commands.add_parser(
        "bench",
        help="run the benchmark suites and print the side-by-side report "
        "(needs a source checkout: the suites and the harness live in its benchmarks/ folder)",
        add_help=False,
    )
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def find_harness(cwd: Path | None = None) -> Path | None:
    """The ``benchmarks/report`` folder of the checkout modstate is imported from, else of ``cwd``.

    Args:
        cwd: Where to look second (default: the current directory).

    Returns:
        The folder, or None when neither place is a checkout with the harness.
    """
    imported_from = Path(modstate.__file__).resolve().parents[2]  # <checkout>/src/modstate
    for root in (imported_from, cwd or Path.cwd()):
        harness = root / "benchmarks" / "report"
        if (harness / "__main__.py").is_file():
            return harness
    return None


def bench(argv: list[str]) -> int:
    """Run the checkout's benchmark harness with ``argv``, or say that it needs a checkout.

    Args:
        argv: The arguments after ``bench``, passed on to ``benchmarks/report``.

    Returns:
        The harness's exit status, or 2 (and one line on stderr) without a checkout.
    """
    harness = find_harness()
    if harness is None:
        print(NEEDS_CHECKOUT, file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(harness), *argv])


def main(argv: list[str] | None = None) -> int:
    """Run ``modstate``'s command line.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 for a usage error.
    """
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        from modstate.cli._demo import run

        return run(
            members=args.members, steps=args.steps, seed=args.seed, progress=not args.no_progress
        )
    parser.print_help()
    return 2
