"""Command line: ``python -m kernelpolicy demo``, ``doctor`` and ``serve``."""

from __future__ import annotations

import argparse
import sys
import warnings

#: The start of torch's warning, at its import, where numpy is not installed.
NO_NUMPY = "Failed to initialize NumPy"
DESCRIPTION = "kernelpolicy: decide at every forward call whether a layer runs its kernel or its original forward."


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["serve"]:  # its options are transformers serve's: handed on as they are
        from .serving import main as serve

        return serve(arguments[1:])
    parser = argparse.ArgumentParser(prog="python -m kernelpolicy", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="kernelize a tiny model with a local kernel and show the path under several policies")
    doctor_parser = sub.add_parser("doctor", help="check that policies reach eager, traced and compiled calls here")
    doctor_parser.add_argument("--verbose", action="store_true", help="also the internals: mechanism, private names")
    sub.add_parser(
        "serve",
        help="transformers serve with a policy per request (X-Kernel-Policy header): serve [--kernel NAME=PATH] "
        "MODEL [transformers serve options]",
    )
    args = parser.parse_args(arguments)
    if args.command == "demo":
        with warnings.catch_warnings():
            # torch warns as it is imported where numpy is not installed, as in the demo's environment (the
            # package alone: .ci/run --demo); the demo uses no numpy. That warning only, at that import only.
            warnings.filterwarnings("ignore", message=NO_NUMPY, category=UserWarning)
            from ._demo import demo

        demo()
        return 0
    from ._tell._doctor import doctor

    report = doctor()
    print(report.verbose() if args.verbose else report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
