"""`mixserve serve | generate | bench | simulate`: one module per subcommand, each with
`register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with register(subparsers) that sets `func(args) -> int` as the parser default
SUBCOMMANDS = {
    "serve": "mixserve.cli.serve",
    "generate": "mixserve.cli.generate",
    "bench": "mixserve.cli.bench",
    "simulate": "mixserve.cli.simulate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixserve", description="A chunked-prefill LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
