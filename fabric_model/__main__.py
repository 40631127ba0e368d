"""Command line: ``python -m fabric_model worker --driver HOST:PORT --worker-id N``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("worker",):
        sys.stderr.write("usage: python -m fabric_model worker --driver HOST:PORT --worker-id N [--device DEV]\n")
        return 2
    from .worker.main import main as worker_main

    return worker_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
