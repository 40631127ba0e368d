"""The Ray cluster a ``cluster="ray"`` job runs on (docs/architecture.md, "Processes", "Ray").

Connected in the caller before any worker starts: ``ray.init()`` resolves the cluster as Ray
always does (``RAY_ADDRESS``, else a cluster ``ray start``-ed on this host, else a new local
one). A caller that already called ``ray.init`` keeps its connection; a connection made here
is closed (and a local cluster started here stopped) when the job ends.

Each worker is one actor asking for one GPU where the cluster has GPUs, else one CPU. Other
shapes come from ``FABRIC_MODEL_RAY_ACTOR_OPTIONS``, a JSON object of Ray actor options
merged over the default, e.g. ``{"num_cpus": 8, "num_gpus": 1, "resources": {"a100": 1}}``;
its ``runtime_env`` entries are merged over ours.
"""

from __future__ import annotations

import logging
import site
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..settings.registry import RAY_ACTOR_OPTIONS, RAY_IGNORE_GITIGNORE
from .base import Launcher
from .ray_console import RayConsole

#: Never uploaded with the script's folder: version control, caches, earlier runs.
EXCLUDES = [".git", "**/__pycache__", "fabric_runs", ".tox", ".venv", "venv"]


def _actor_options_from_environment() -> dict[str, Any]:
    """``$FABRIC_MODEL_RAY_ACTOR_OPTIONS``, a JSON object (checked by the registry), else none."""
    return RAY_ACTOR_OPTIONS.get() or {}


def script_folder() -> Path:
    """The folder of the user's script (``__main__``), else the current directory (a notebook,
    ``python -m pytest``, an installed command such as ``pytest`` or ``fabric-model run``, an
    interactive session)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file:
        folder = Path(main_file).resolve().parent
        paths = sysconfig.get_paths()
        installed = {Path(p).resolve() for p in [*site.getsitepackages(), paths["stdlib"]]}
        # A console script's folder (a virtualenv's bin/) is no script folder: never upload it.
        commands = {Path(paths["scripts"]).resolve(), Path(sys.prefix, "bin").resolve()}
        if folder not in commands and not any(folder == p or p in folder.parents for p in installed):
            return folder
    return Path.cwd()


def runtime_env(user: dict[str, Any] | None = None) -> dict[str, Any]:
    """The actors' runtime_env: the script's folder as ``working_dir`` (Ray uploads it, at most
    a few hundred MiB: keep data out of it or name another folder in ``runtime_env``) and this
    ``fabric_model`` package as a ``py_module``, so every node runs the caller's code."""
    package = str(Path(__file__).resolve().parents[1])
    env: dict[str, Any] = {"working_dir": str(script_folder()), "py_modules": [package], "excludes": list(EXCLUDES)}
    env.update(user or {})
    return env


def _upload(env: dict[str, Any]) -> dict[str, Any]:
    """``env`` with its local folders uploaded to the cluster and named by URI.

    Ray uploads local folders only for a job-level runtime_env (``ray.init``), and the caller
    may have connected already; actor options need URIs. These are the helpers ``ray.init``
    itself calls (private; present from Ray 2.9 to 2.60, at least)."""
    import ray
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    node: Any = ray._private.worker.global_worker.node
    scratch = node.get_runtime_env_dir_path()
    gitignore = not RAY_IGNORE_GITIGNORE.get()  # as Ray's own uploads read it
    loggers = [logging.getLogger(f"ray._private.runtime_env.{name}") for name in ("py_modules", "working_dir")]
    for logger in loggers:
        logger.addFilter(quiet_default_excludes)
    try:
        env = upload_py_modules_if_needed(env, include_gitignore=gitignore, scratch_dir=scratch)
        env = upload_working_dir_if_needed(env, include_gitignore=gitignore, scratch_dir=scratch)
    finally:
        for logger in loggers:
            logger.removeFilter(quiet_default_excludes)
    env.pop("excludes", None)
    return env


def quiet_default_excludes(record: logging.LogRecord) -> bool:
    """Drops Ray's warning that a folder of its default excludes (``__pycache__``, ``.git``) is no
    longer uploaded: ``EXCLUDES`` leaves them out anyway, and the user's console gets our lines only."""
    return "is now ignored by default when packaging" not in str(record.msg)


class RayCluster:
    """The connection to the Ray cluster, and what every worker actor asks of it."""

    def __init__(self) -> None:
        options = _actor_options_from_environment()  # a bad value fails before connecting
        try:
            import ray
        except ImportError as exc:  # cluster.check_cluster found it; a broken install still says how
            raise ImportError("cluster='ray' needs Ray. HINT: pip install fabric-model[ray]") from exc
        self._ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            ray.init()
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        default: dict[str, Any] = {"num_gpus": 1} if has_gpus else {"num_cpus": 1}
        user_env = options.pop("runtime_env", None)
        self.actor_options: dict[str, Any] = {**default, **options, "runtime_env": _upload(runtime_env(user_env))}
        self._console: RayConsole | None = None

    @property
    def gpus_per_worker(self) -> int:
        """1 when each worker gets a GPU (it uses ``cuda:0`` of what Ray made visible), else 0."""
        return 1 if float(self.actor_options.get("num_gpus") or 0) > 0 else 0

    @property
    def threads(self) -> int:
        """Intra-op threads per worker: the CPUs its actor asks for (at least 1)."""
        return max(1, int(float(self.actor_options.get("num_cpus") or 1)))

    @property
    def actor_shape(self) -> str:
        """What each worker's actor asks Ray for, as the start-up line says it: "1 CPU", "1 GPU, 8 CPUs"."""
        options = self.actor_options

        def amount(value: Any, name: str) -> str:
            return f"{float(value):g} {name}{'' if float(value) == 1 else 's'}"

        kinds = (("num_gpus", "GPU"), ("num_cpus", "CPU"))
        parts = [amount(options[key], name) for key, name in kinds if options.get(key)]
        parts += [f"{float(v):g} {k}" for k, v in (options.get("resources") or {}).items()]
        return ", ".join(parts) or "nothing"

    @property
    def host(self) -> str:
        """The address the driver listens on: this node's IP as Ray sees it (loopback offline)."""
        return str(self._ray.util.get_node_ip_address())

    def launcher_factory(self, log_path: Callable[[int], Path]) -> Callable[[tuple[str, int], bytes], Launcher]:
        """Makes the job's :class:`~fabric_model.launchers.ray.RayLauncher` (the driver's factory)."""
        from .ray import RayLauncher

        def make(address: tuple[str, int], secret: bytes) -> Launcher:
            # Ray's raylet reports (a node lost) go to logs/ray.log until the connection closes.
            self._console = RayConsole(log_path(0).parent / "ray.log")
            self._console.install()
            return RayLauncher(address, secret, log_path, self.actor_options, self.threads)

        return make

    def close(self) -> None:
        """Disconnect, stopping the local cluster if this job started it."""
        if self.started and self._ray.is_initialized():
            self._ray.shutdown()
        if self._console is not None:
            self._console.close()
