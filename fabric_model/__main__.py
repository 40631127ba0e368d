"""Command line: ``python -m fabric_model worker --driver HOST:PORT --worker-id N`` and
``fabric-model run [--keras2-optimizers] SCRIPT [ARGS...]`` (IBM EDT scripts; docs/ibm-migration.md)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("worker", "run"):
        sys.stderr.write(
            "usage: python -m fabric_model worker --driver HOST:PORT --worker-id N [--device DEV]\n"
            "       python -m fabric_model run [--keras2-optimizers] SCRIPT [ARGS...]\n"
        )
        return 2
    if args[0] == "run":  # imported only here: `worker` stays light
        from .ibm.runtime import main as run_main

        return run_main(args[1:])
    from .worker.main import main as worker_main

    return worker_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
