"""Every environment variable fabric_model reads, declared once: name, default, parser, meaning.

Code reads a setting through its accessor (``CPU_WORKERS.get()``) or by name
(``get("FABRIC_MODEL_CPU_WORKERS")``); nothing else in the package reads ``os.environ``
(tests/test_settings.py checks it). Code that *builds* an environment (copies ``os.environ`` for
a child process, sets a variable for one) writes it directly.

An unset or blank variable means the default (except where ``""`` is itself a value:
``CUDA_VISIBLE_DEVICES=""`` hides every GPU). A value the parser refuses raises ``ValueError``
naming the variable, the value received and what is accepted.

Names, public and internal:

- **Public** settings are the users' to set, and docs/configuration.md lists them (generated:
  ``python -m fabric_model.settings.registry > docs/configuration.md``): fabric_model's own
  ``FABRIC_MODEL_*``; IBM WMLA's names, spelled exactly as
  IBM did because users' scripts set them (``EDT_*``, ``RESULT_DIR``, ``LOG_DIR``,
  ``FABRIC_HOME`` ...); and other programs' variables the package also reads
  (``CUDA_VISIBLE_DEVICES``, ``TF_CPP_MIN_LOG_LEVEL`` ...).
- **Internal** settings are set by the package for its own processes and are not for users.
  The rule: an internal name starts with :data:`INTERNAL_PREFIX` (``_FABRIC_MODEL_``), and no
  public name starts with an underscore; :func:`declare` enforces both.

Standard library only: ``import fabric_model`` must not import torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .profile_window import ProfileWindow
from .profile_window import parse_setting as parse_profile_setting

T = TypeVar("T")

#: Every internal setting's name starts with this; no public one starts with "_".
INTERNAL_PREFIX = "_FABRIC_MODEL_"


@dataclasses.dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable; :meth:`get` reads and checks it.

    Attributes:
        name: the variable's name.
        default: the value when the variable is unset (or blank).
        parse: the value from the variable's text; raises ``ValueError`` on text it does not accept.
        accepted: what ``parse`` accepts, as the error says it ("a positive integer").
        doc: one line for docs/configuration.md.
        internal: set by the package for its own processes, not by users.
        shown_default: the default as the docs show it, where the value itself says too little.
        keep_blank: ``""`` is a value, not "unset".
    """

    name: str
    default: T
    parse: Callable[[str], T]
    accepted: str
    doc: str
    internal: bool = False
    shown_default: str | None = None
    keep_blank: bool = False

    def raw(self) -> str | None:
        """The variable's text; None when it is unset, or blank and ``keep_blank`` is off."""
        text = os.environ.get(self.name)
        if text is None or (not text.strip() and not self.keep_blank):
            return None
        return text

    def is_set(self) -> bool:
        """Whether the variable holds a value (blank counts as unset unless ``keep_blank``)."""
        return self.raw() is not None

    def get(self) -> T:
        """The variable's value, else the default; ``ValueError`` on a value ``parse`` refuses."""
        text = self.raw()
        return self.default if text is None else self.parse_text(text)

    def parse_text(self, text: str) -> T:
        """``text`` as this setting's value; the error names the variable, ``text`` and what is accepted."""
        try:
            return self.parse(text)
        except ValueError:
            raise ValueError(f"Expected {self.name} to be {self.accepted}. Received: {self.name}={text!r}") from None

    def default_text(self) -> str:
        """The default as docs/configuration.md shows it."""
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None:
            return "unset"
        return f"`{_shown(self.default)}`"


#: Every setting by name, in the order of declaration (docs/configuration.md's order).
REGISTRY: dict[str, Setting[Any]] = {}


def declare(setting: Setting[T]) -> Setting[T]:
    """Register ``setting``: a new name, internal exactly when it starts with :data:`INTERNAL_PREFIX`."""
    if setting.name in REGISTRY:
        raise ValueError(f"Expected a new setting name. Received: {setting.name!r}, declared twice")
    if setting.internal:
        follows, kind, rule = setting.name.startswith(INTERNAL_PREFIX), "an internal", f"start with {INTERNAL_PREFIX!r}"
    else:
        follows, kind, rule = not setting.name.startswith("_"), "a public", "not start with '_'"
    if not follows:
        raise ValueError(f"Expected {kind} setting's name to {rule}. Received: {setting.name!r}")
    REGISTRY[setting.name] = setting
    return setting


def setting(name: str) -> Setting[Any]:
    """The setting named ``name``."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"Expected the name of a setting declared in fabric_model/settings/registry.py. Received: {name!r}"
        ) from None


def get(name: str) -> Any:
    """The value of the setting named ``name`` (see :meth:`Setting.get`)."""
    return setting(name).get()


def public() -> list[Setting[Any]]:
    """The settings users may set, in declaration order."""
    return [s for s in REGISTRY.values() if not s.internal]


def internal() -> list[Setting[Any]]:
    """The settings the package sets for its own processes."""
    return [s for s in REGISTRY.values() if s.internal]


# -- parsers: each raises ValueError on text it does not accept --------------------------------
def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _text(text: str) -> str:
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _whole(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


def _seconds_or_zero(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(text)
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:  # NaN fails too
        raise ValueError(text)
    return value


def _flag(text: str) -> bool:
    value = text.strip()
    if value not in ("0", "1"):
        raise ValueError(text)
    return value == "1"


def _one_of(values: tuple[str, ...]) -> Callable[[str], str]:
    """A parser of ``values`` (case and surrounding blanks ignored), returning the value as listed."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in values:
            raise ValueError(text)
        return value

    return parse


def _accepted_choices(values: tuple[str, ...]) -> str:
    return "one of " + ", ".join(repr(v) for v in values)


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)  # json.JSONDecodeError is a ValueError
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


def _ray_flag(text: str) -> bool:
    return text.strip() == "1"  # Ray's own reading: anything else is "off"


def _preempt_signals(text: str) -> tuple[str, ...]:
    """``SIGTERM,SIGUSR1`` (or ``TERM,USR1``) as canonical names; SIGKILL and SIGSTOP cannot be
    caught, and SIGINT is Ctrl-C's."""
    import signal

    names = []
    for part in text.split(","):
        name = part.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name in ("SIGKILL", "SIGSTOP", "SIGINT") or not hasattr(signal.Signals, name):
            raise ValueError(text)
        names.append(name)
    return tuple(dict.fromkeys(names))


_FLAG = "1 or 0"
_POSITIVE = "a positive integer"
_SECONDS = "a positive number of seconds"


# -- fabric_model's own ------------------------------------------------------------------------
CPU_WORKERS: Setting[int | None] = declare(
    Setting(
        "FABRIC_MODEL_CPU_WORKERS",
        None,
        _positive_int,
        _POSITIVE,
        "The most CPU workers on a host without a GPU.",
        shown_default="one per usable core",
    )
)
LOCAL_WORKERS: Setting[int | None] = declare(
    Setting(
        "FABRIC_MODEL_LOCAL_WORKERS",
        None,
        _whole,
        "an integer >= 0",
        "The most workers the driver starts on its own host (0: none, every worker is started by hand "
        "or elsewhere); `engines_number` still counts them all.",
        shown_default="as many as its devices allow",
    )
)
WORKERS_PER_GPU: Setting[int] = declare(
    Setting(
        "FABRIC_MODEL_WORKERS_PER_GPU",
        1,
        _positive_int,
        _POSITIVE,
        "Local workers that share each GPU; shared GPUs reduce over gloo, not NCCL.",
    )
)
DETERMINISTIC_THREADS: Setting[int] = declare(
    Setting(
        "FABRIC_MODEL_DETERMINISTIC_THREADS",
        1,
        _positive_int,
        _POSITIVE,
        "Intra-op threads of every CPU worker with `deterministic=True`, however many workers there are.",
    )
)
SMALL_STEP_FLOPS: Setting[float] = declare(
    Setting(
        "FABRIC_MODEL_SMALL_STEP_FLOPS",
        4e6,
        _seconds_or_zero,
        "a number, 0 or more",
        "A CPU worker the driver starts runs one intra-op thread when a micro-batch's training step is "
        "estimated below this many floating-point operations, from the first batch (`0`: never); "
        'docs/architecture.md, "Intra-op threads".',
    )
)
#: ``FABRIC_MODEL_WARM_START``'s values: no warm process; a fork of the caller where it is fit
#: for one, else a fresh interpreter (``1``, the default, or ``fork``); always a fresh
#: interpreter; always a fork (its OpenMP probe the only check: for diagnosis). See
#: docs/architecture.md, "Start-up".
WARM_STARTS = ("0", "1", "fresh", "fork", "fork-always")
WARM_START: Setting[str] = declare(
    Setting(
        "FABRIC_MODEL_WARM_START",
        "1",
        _one_of(WARM_STARTS),
        _accepted_choices(WARM_STARTS),
        "`1`/`fork`: the warm process is a fork of the caller where that is safe, else a fresh interpreter; "
        "`fresh`: always a fresh interpreter; `fork-always`: always a fork (for diagnosis); `0`: no warm process.",
    )
)
WARM_KEEP: Setting[float] = declare(
    Setting(
        "FABRIC_MODEL_WARM_KEEP",
        600.0,
        _seconds_or_zero,
        "a number of seconds, 0 or more",
        "Seconds a job's warm process, when it is a fresh interpreter, is kept after the job for the next "
        "`train()` of the same process (a notebook, a sweep) before it ends (`0`: it ends with its job); "
        'docs/architecture.md, "Start-up".',
    )
)
KEEP_FREED_MEMORY: Setting[bool] = declare(
    Setting(
        "FABRIC_MODEL_KEEP_FREED_MEMORY",
        True,
        _flag,
        "1 (workers keep freed memory for their next step) or 0 (glibc's defaults)",
        "`1`: workers keep freed memory for their next step; `0`: glibc's defaults.",
    )
)
SNAPSHOT_STEPS: Setting[int] = declare(
    Setting(
        "FABRIC_MODEL_SNAPSHOT_STEPS",
        100,
        _whole,
        "a whole number of steps, 0 or more",
        "Rank 0 sends the driver an in-memory snapshot of the state every N committed steps (`0`: not by steps).",
    )
)
SNAPSHOT_SECONDS: Setting[float] = declare(
    Setting(
        "FABRIC_MODEL_SNAPSHOT_SECONDS",
        30.0,
        _seconds_or_zero,
        "a number of seconds, 0 or more",
        "... or once this many seconds have passed since the last one (`0`: not by time).",
    )
)
SNAPSHOT_SHARE: Setting[float] = declare(
    Setting(
        "FABRIC_MODEL_SNAPSHOT_SHARE",
        0.01,
        _fraction,
        "a fraction of the training time, 0 or more and below 1",
        "The steps' rule waits while snapshots would take more than this share of the time (`0`: never waits).",
    )
)
PREEMPT_SIGNALS: Setting[tuple[str, ...]] = declare(
    Setting(
        "FABRIC_MODEL_PREEMPT_SIGNALS",
        ("SIGTERM",),
        _preempt_signals,
        "signal names separated by commas (SIGTERM,SIGUSR1), not SIGKILL, SIGSTOP or SIGINT",
        'The signals that mean "leave now, keep the work": a worker leaves after its step, the driver '
        'saves a checkpoint and exits (docs/elasticity.md, "Preemption").',
        shown_default="`SIGTERM`",
    )
)
PREEMPT_GRACE: Setting[float] = declare(
    Setting(
        "FABRIC_MODEL_PREEMPT_GRACE",
        20.0,
        _positive_seconds,
        _SECONDS,
        "How long a preempted worker may take to finish its step, and the driver to save and exit; "
        "past it, a worker leaves as a lost one does and the driver keeps the newest state it holds.",
    )
)
DIVERGENCE_CHECK_STEPS: Setting[int] = declare(
    Setting(
        "FABRIC_MODEL_DIVERGENCE_CHECK_STEPS",
        50,
        _whole,
        "a whole number of steps, 0 or more",
        "Replicas compare per-tensor fingerprints of their state every N steps and after each epoch's last step; "
        "a difference ends training with rank 0's state written (`0`: only at the end of training).",
    )
)
OMIT_FROZEN: Setting[bool] = declare(
    Setting(
        "FABRIC_MODEL_OMIT_FROZEN",
        True,
        _flag,
        _FLAG,
        "`1`: parameters that need no gradient travel with the job only, while they keep its values; `0`: every "
        'snapshot, checkpoint upload and join carries them (docs/training.md, "Frozen parameters").',
    )
)
PROFILE: Setting[ProfileWindow | None] = declare(
    Setting(
        "FABRIC_MODEL_PROFILE",
        None,
        parse_profile_setting,
        "1 (steps 10-19), 0, a number of steps N (from step 10), or FIRST:STOP (global steps)",
        "Profile rank 0's steps when `train(profile=)` is not given: a torch profiler trace and a summary of "
        "where a step's time went, in the run directory's `profile/` (docs/training.md, \"Profiling\").",
    )
)
BIND_ADDRESS: Setting[str | None] = declare(
    Setting(
        "FABRIC_MODEL_BIND_ADDRESS",
        None,
        _text,
        "an address of this host",  # transport/network.py checks it, naming the variable
        "Where the driver listens when `train(bind_address=)` is not given: an IPv4 address of this host, "
        "a host name resolving to one, or `0.0.0.0`.",
        shown_default="`127.0.0.1`",
    )
)
#: The accepted values of ``train(cluster=...)`` and of ``FABRIC_MODEL_CLUSTER``.
CLUSTERS = ("local", "ray")
CLUSTER: Setting[str | None] = declare(
    Setting(
        "FABRIC_MODEL_CLUSTER",
        None,
        _one_of(CLUSTERS),
        _accepted_choices(CLUSTERS),
        "The default of `train(cluster=)`: `local` processes, or `ray` actors on the cluster of `RAY_ADDRESS`.",
        shown_default="`local`",
    )
)
RAY_ACTOR_OPTIONS: Setting[dict[str, Any] | None] = declare(
    Setting(
        "FABRIC_MODEL_RAY_ACTOR_OPTIONS",
        None,
        _json_object,
        'a JSON object of Ray actor options, e.g. {"num_cpus": 4, "num_gpus": 1}',
        "A JSON object of Ray actor options for every worker actor, merged over the default; its `runtime_env` "
        "entries are merged over fabric_model's.",
        shown_default="one GPU where the cluster has GPUs, else one CPU",
    )
)
SECRET: Setting[str | None] = declare(
    Setting(
        "FABRIC_MODEL_SECRET",
        None,
        _text,
        "the job's secret in hex",  # worker/cli.py checks it
        "The job's secret (hex: `join.json`'s `secret`) for a worker started by hand with `fabric-model worker`; "
        "launchers set it for theirs. Never on a command line.",
    )
)
UI_PARAMETERS: Setting[str | None] = declare(
    Setting(
        "_FABRIC_MODEL_UI_PARAMETERS",
        None,
        _text,
        "a JSON file",
        "The values `fabric-model run --param/--params` gave IBM's `pth_parameter_mgr` (ibm/ui_parameters.py).",
        internal=True,
    )
)
TF_USE_LEGACY_KERAS: Setting[str | None] = declare(
    Setting(
        "TF_USE_LEGACY_KERAS",
        None,
        _text,
        "TensorFlow's: `1` makes `tf.keras` Keras 2 (the tf-keras package)",
        "TensorFlow's choice of Keras; `fabric-model run` sets `1` for a TensorFlow script "
        "unless it is set or `--keras3` is given.",
        shown_default="unset (`fabric-model run`: `1` for TensorFlow scripts)",
    )
)

# -- IBM WMLA's (Elastic Distributed Training), as IBM named them -------------------------------
START_TIMEOUT: Setting[float] = declare(
    Setting(
        "EDT_START_TIME_OUT",
        120.0,
        _positive_seconds,
        _SECONDS,
        "Seconds a started worker has to connect to the driver and register.",
    )
)
COLLECTIVE_TIMEOUT: Setting[float] = declare(
    Setting(
        "EDT_COLLECTIVE_TIME_OUT",
        120.0,
        _positive_seconds,
        _SECONDS,
        "Seconds after which a collective (allreduce, broadcast) counts as failed.",
    )
)
STOP_TIMEOUT: Setting[float] = declare(
    Setting(
        "EDT_STOP_TIME_OUT",
        10.0,
        _positive_seconds,
        _SECONDS,
        "Seconds workers have to exit once the driver asks them to stop; then they are killed.",
    )
)
HEARTBEAT_TIMEOUT: Setting[float] = declare(
    Setting(
        "EDT_HEARTBEAT_TIME_OUT",
        10.0,
        _positive_seconds,
        _SECONDS,
        "Seconds of silence (no heartbeat) after which a worker is taken for frozen and removed, and killed if local.",
    )
)
PULL_TIMEOUT: Setting[float] = declare(
    Setting(
        "EDT_PULL_WEIGHT_TIME_OUT",
        60.0,
        _positive_seconds,
        _SECONDS,
        "Seconds a joining worker waits for its generation and the state it pulls from a peer.",
    )
)
RECOVERY_TIMEOUT: Setting[float] = declare(
    Setting(
        "EDT_RECOVERY_TIME_OUT",
        120.0,
        _positive_seconds,
        _SECONDS,
        "Seconds a worker waits for the driver's next generation after a failed collective.",
    )
)
PULL_FAILED_LIMITS: Setting[int] = declare(
    Setting(
        "EDT_PULL_FAILED_LIMITS",
        3,
        _positive_int,
        _POSITIVE,
        "Failed pulls after which a joining worker gives up (the job goes on without it).",
    )
)
DRIVER_WAIT: Setting[float] = declare(
    Setting(
        "FABRIC_MODEL_DRIVER_WAIT",
        180.0,
        _seconds_or_zero,
        "a number of seconds, 0 or more",
        "Seconds a worker holding the training state waits for a driver that vanished without stopping it "
        "(SIGKILL, its host lost) to come back at the same address (`0`: it exits at once): the same command "
        'with `resume="auto"` takes the workers back (docs/elasticity.md, "A lost driver").',
    )
)
REPLACE_WORKERS: Setting[bool] = declare(
    Setting(
        "EDT_REPLACE_WORKERS",
        True,
        _flag,
        _FLAG,
        "`1`: lost local workers are replaced; `0`: they are not.",
    )
)
RESULT_DIR: Setting[str | None] = declare(
    Setting(
        "RESULT_DIR",
        None,
        _text,
        "a directory",
        "The run directory when `train(run_dir=)` is not given; `fabric-model run` sets it.",
        shown_default="`./fabric_runs/<time>-<hex>`",
    )
)
LOG_DIR: Setting[str | None] = declare(
    Setting(
        "LOG_DIR",
        None,
        _text,
        "a directory",
        "Where IBM's `emetrics` and `elog` modules write; `fabric-model run` sets it.",
        shown_default="`$RESULT_DIR/logs`",
    )
)
JOB_STATE_DIR: Setting[str | None] = declare(
    Setting(
        "JOB_STATE_DIR",
        None,
        _text,
        "a directory",
        "IBM's older log location: `emetrics` and `elog` write to `$JOB_STATE_DIR/logs` when `LOG_DIR` is unset.",
    )
)
DATA_DIR: Setting[str | None] = declare(
    Setting(
        "DATA_DIR",
        None,
        _text,
        "a directory",
        "Where IBM scripts find their data files; `fabric-model run` sets it.",
        shown_default="the script's directory",
    )
)
FABRIC_HOME: Setting[str | None] = declare(
    Setting(
        "FABRIC_HOME",
        None,
        _text,
        "a directory",
        "Holds `libs/fabric.zip`, IBM's runtime modules; `fabric-model run` sets it.",
        shown_default="`$RESULT_DIR/fabric_home`",
    )
)
TRAINING_ID: Setting[str | None] = declare(
    Setting(
        "TRAINING_ID",
        None,
        _text,
        "a training id",
        "The `training_id` of `emetrics` records; `fabric-model run` sets it.",
        shown_default="the run directory's name",
    )
)

# -- other programs' variables the package reads -------------------------------------------------
CUDA_VISIBLE: Setting[str | None] = declare(
    Setting(
        "CUDA_VISIBLE_DEVICES",
        None,
        _text,
        "a list of GPUs",
        "CUDA's GPU list. A value the script sets after the process started (TensorFlow scripts' `\"\"`) is "
        "the driver's own: workers get the value the process started with.",
        keep_blank=True,
    )
)
TF_LOG_LEVEL: Setting[str] = declare(
    Setting(
        "TF_CPP_MIN_LOG_LEVEL",
        "2",
        _text,
        "a TensorFlow log level",
        "TensorFlow's; fabric_model sets `2` where it is unset. `0` or `1` also shows TensorFlow's start-up "
        "notices, which fabric_model hides otherwise.",
    )
)
GLOO_SOCKET_IFNAME: Setting[str | None] = declare(
    Setting(
        "GLOO_SOCKET_IFNAME",
        None,
        _text,
        "a network interface",
        "gloo's; where it is unset, a worker sets it (and `NCCL_SOCKET_IFNAME`) to the interface that routes "
        "to the driver.",
        shown_default="the interface towards the driver",
    )
)
RAY_IGNORE_GITIGNORE: Setting[bool] = declare(
    Setting(
        "RAY_RUNTIME_ENV_IGNORE_GITIGNORE",
        False,
        _ray_flag,
        "1, or anything else for off",
        "Ray's; `1`: the script's folder is uploaded to the cluster without honouring `.gitignore` files.",
    )
)

# -- internal: set by the package for its own processes ------------------------------------------
LAUNCHED: Setting[bool] = declare(
    Setting(
        "_FABRIC_MODEL_LAUNCHED",
        False,
        _flag,
        _FLAG,
        "Set by the launchers: the worker dies with its parent (a warm process keeps its workers for a "
        "vanished driver) and leaves Ctrl-C to the driver.",
        internal=True,
    )
)
JOIN_FILE: Setting[str | None] = declare(
    Setting(
        "_FABRIC_MODEL_JOIN_FILE",
        None,
        _text,
        "a path",
        "Set by the local launcher: the run's `join.json`, which a worker that waited in vain for its "
        "vanished driver removes (it holds the job's secret).",
        internal=True,
    )
)
TF_NOTICES: Setting[bool] = declare(
    Setting(
        "_FABRIC_MODEL_TF_NOTICES",
        False,
        _flag,
        _FLAG,
        "Set by `train(verbose=2)` for the workers it starts: they show TensorFlow's start-up notices.",
        internal=True,
    )
)


# -- docs/configuration.md ---------------------------------------------------------------------
_PAGE_HEAD = """\
# Configuration: environment variables

<!-- Generated from fabric_model/settings/registry.py by
`python -m fabric_model.settings.registry > docs/configuration.md`; tests/test_settings.py fails
when this page and the registry differ. Edit the registry, not this page. -->

Every environment variable fabric_model reads. Unset or empty means the default. A value that is
not accepted fails with an error naming the variable, the value and what is accepted; those that
shape a job are read once, in the process that calls `train()`, so a bad one fails there, before
any worker starts. The `EDT_*` names and `RESULT_DIR`, `LOG_DIR`, `JOB_STATE_DIR`, `DATA_DIR`,
`FABRIC_HOME` and `TRAINING_ID` are IBM WMLA's, spelled as IBM did.

| Variable | Default | Meaning |
|---|---|---|
"""


def markdown() -> str:
    """docs/configuration.md: every public setting in one table, then a note on the internal ones."""
    rows = [f"| `{s.name}` | {s.default_text()} | {s.doc} |\n" for s in public()]
    names = ", ".join(f"`{s.name}`" for s in internal())
    note = (
        f"\nInternal variables, whose names start with `{INTERNAL_PREFIX}` ({names}),\n"
        "are set by fabric_model for its own processes. They are not for users and may change without notice.\n"
    )
    return _PAGE_HEAD + "".join(rows) + note


if __name__ == "__main__":
    sys.stdout.write(markdown())
