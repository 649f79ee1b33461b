"""Command line: ``python -m kernelpolicy demo`` and ``python -m kernelpolicy doctor``."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = "kernelpolicy: decide at every forward call whether a layer runs its kernel or its original forward."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernelpolicy", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="kernelize a tiny model with a local kernel and show the path under several policies")
    doctor_parser = sub.add_parser("doctor", help="check that policies reach eager, traced and compiled calls here")
    doctor_parser.add_argument("--verbose", action="store_true", help="also the internals: mechanism, private names")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import demo

        demo()
        return 0
    from ._doctor import doctor

    report = doctor()
    print(report.verbose() if args.verbose else report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
