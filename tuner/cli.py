"""``python -m tuner``: the command line."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tuner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="tune the kernel for one problem")
    run.add_argument("--dk", type=int, default=128)
    run.add_argument("--dv", type=int, default=128)
    args = parser.parse_args(argv)
    print(f"tuner {args.command}: the Optuna study is not built yet (issue 3).", file=sys.stderr)
    return 1
