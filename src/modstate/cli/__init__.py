"""The ``modstate`` command line: ``python -m modstate {demo,bench}``."""

from __future__ import annotations

import argparse
import sys

from modstate import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modstate",
        description="PyTorch model state as JAX-style pytrees.",
    )
    parser.add_argument("--version", action="version", version=f"modstate {__version__}")
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
        "(needs a source checkout: the suites live in its benchmarks/ folder)",
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["bench"]:
        from modstate.cli._report import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        from modstate.cli._demo import run

        return run(
            members=args.members, steps=args.steps, seed=args.seed, progress=not args.no_progress
        )
    parser.print_help()
    return 2
