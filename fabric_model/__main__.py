"""Command line: ``fabric-model worker ...`` joins a running job as one more worker (launched
workers use it too); ``fabric-model run [--keras2-optimizers] SCRIPT [ARGS...]`` runs an IBM EDT
script (docs/ibm-migration.md). ``python -m fabric_model`` is the same."""

from __future__ import annotations

import sys

from .worker import cli

DESCRIPTION = "fabric-model: elastic data-parallel training for PyTorch and Keras."
RUN_USAGE = "fabric-model run [--keras2-optimizers] SCRIPT [ARGS...]"


def help_text() -> str:
    """The top-level help: every subcommand with its options."""
    worker = cli.parser()
    return (
        f"usage: fabric-model {{worker,run}} ...\n\n{DESCRIPTION}\n\ncommands:\n"
        f"  worker   join a running job as one more worker, on this host or another\n"
        f"           (the README's 'Workers on other hosts')\n"
        f"  run      run an IBM EDT script unchanged (docs/ibm-migration.md)\n\n"
        f"{worker.format_help()}\n"
        f"usage: {RUN_USAGE}\n"
        f"  --keras2-optimizers  Keras 2 optimizer semantics for the script's optimizers\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":  # imported only here: `worker` stays light
        from .ibm.runtime import main as run_main

        return run_main(args[1:])
    if args and args[0] == "worker":
        cli.parser().parse_args(args[1:])  # usage errors and --help before torch is imported
        from .worker.main import main as worker_main

        return worker_main(args[1:])
    asked = bool(args) and args[0] in ("-h", "--help", "help")
    (sys.stdout if asked else sys.stderr).write(help_text())
    return 0 if asked else 2


if __name__ == "__main__":
    sys.exit(main())
