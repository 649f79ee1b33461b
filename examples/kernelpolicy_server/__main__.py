"""``python -m examples.kernelpolicy_server --port 8000``: serve the example on 127.0.0.1 with uvicorn."""

from __future__ import annotations

import argparse

import uvicorn

from . import create_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.kernelpolicy_server", description=__doc__)
    parser.add_argument("--port", type=int, default=8000, help="TCP port on 127.0.0.1 (default 8000)")
    parser.add_argument("--workers", type=int, default=4, help="model worker threads (default 4)")
    parser.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    parser.add_argument("--no-access-log", action="store_true", help="do not log each request")
    parser.add_argument("--compile", action="store_true", help="compiled serving of an allowlist of policies")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="POLICY",
        help="with --compile: a policy to serve (repeatable; the default policy is always served)",
    )
    args = parser.parse_args(argv)
    if args.policies and not args.compile:
        parser.error("--policy is an allowlist for compiled serving; add --compile")
    uvicorn.run(
        create_app(
            workers=args.workers, compile=args.compile, compile_backend=args.compile_backend, policies=args.policies
        ),
        host="127.0.0.1",
        port=args.port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
    )


if __name__ == "__main__":
    main()
