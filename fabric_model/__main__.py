"""Command line ``fabric-model`` (``python -m fabric_model`` is the same), on argparse subcommands:

- ``run [--keras3] [--param NAME=VALUE]... SCRIPT [ARGS...]``: an IBM EDT script, unchanged (docs/ibm-migration.md);
- ``worker``: join a running job as one more worker (launched workers use it too);
- ``status RUN_DIR``: progress, workers and the last checkpoint, as a table;
- ``plot RUN_DIR [-o PNG]``: the loss and each metric per step, validation, the worker count when it changed.

Each subcommand imports what it needs only when it runs: ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .worker import cli

DESCRIPTION = "fabric-model: elastic data-parallel training for PyTorch and Keras."


def parser() -> argparse.ArgumentParser:
    epilog = (
        "usage of each command (fabric-model COMMAND --help for more):\n"
        f"  {cli.parser().format_usage().removeprefix('usage: ').strip()}\n"
        "  fabric-model run [--keras3] [--param NAME=VALUE]... [--params FILE] SCRIPT [ARGS...]\n"
        "  fabric-model status RUN_DIR\n"
        "  fabric-model plot RUN_DIR [-o PNG]\n"
    )
    top = argparse.ArgumentParser(
        prog="fabric-model",
        description=DESCRIPTION,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--version", action="version", version=f"fabric-model {__version__}")
    sub = top.add_subparsers(dest="command", metavar="{run,worker,status,plot}")
    run = sub.add_parser("run", help="run an IBM EDT script unchanged (docs/ibm-migration.md)")
    run.add_argument("--keras3", action="store_true", help="a TensorFlow script gets Keras 3 (default: Keras 2)")
    run.add_argument("--param", action="append", metavar="NAME=VALUE", help="a value for IBM's pth_parameter_mgr")
    run.add_argument("--params", metavar="FILE", help="pth_parameter_mgr's values as a JSON object")
    run.add_argument("script", metavar="SCRIPT", help="the script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    cli.add_arguments(
        sub.add_parser(
            "worker",
            help="join a running job as one more worker, on this host or another",
            description="Join a running fabric-model job as one more worker (this host's device).",
        )
    )
    status = sub.add_parser("status", help="a run's progress, workers and last checkpoint, as a table")
    status.add_argument("run_dir", metavar="RUN_DIR")
    plot = sub.add_parser("plot", help="a PNG of a run: loss and metrics per step, validation, worker count over time")
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("-o", "--output", metavar="PNG", help="default: RUN_DIR/plot.png")
    return top


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    top = parser()
    if args_list[:1] == ["run"]:  # the runtime parses its own line: the script's options pass through untouched
        from .ibm.runtime import main as run_main

        return run_main(args_list[1:])
    if args_list[:1] == ["worker"]:
        cli.parser().parse_args(args_list[1:])  # usage errors and --help before torch is imported
        from .worker.main import main as worker_main

        return worker_main(args_list[1:])
    args = top.parse_args(args_list)
    if args.command in ("status", "plot"):
        from .run.status import status_table, summarize

        try:
            if args.command == "status":
                print(status_table(summarize(args.run_dir)))
            else:
                from .run.plot import plot_run

                print(plot_run(args.run_dir, args.output))
        except (FileNotFoundError, ImportError) as exc:
            sys.stderr.write(f"fabric-model {args.command}: {exc}\n")
            return 2
        return 0
    top.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
