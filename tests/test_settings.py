"""The settings registry (fabric_model/settings/registry.py): every environment variable the package
reads is declared there and read only through it; docs/configuration.md is generated from it; bad
values fail naming the variable, the value and what is accepted. In-process and fast."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric_model.settings import registry as settings
from fabric_model.setup.config import SnapshotCadence, Timeouts

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fabric_model"
REGISTRY_FILE = PACKAGE / "settings" / "registry.py"

#: Methods of ``os.environ`` that build an environment (for this process's libraries or its children).
BUILDERS = {"setdefault", "pop", "update", "clear"}
#: Functions that hand ``os.environ`` on as a mapping to *write* into, and why; a read there would slip by.
HANDED_ON = {
    ("transport/network.py", "select_interfaces"): "points gloo and NCCL at an interface, by setdefault only",
    ("transport/nccl.py", "prepare"): "sets NCCL's failure handling for an elastic worker, by setdefault only",
}
#: Names that look like settings: fabric_model's and IBM's prefixes (``_FABRIC_MODEL_*`` included).
NAME = re.compile(r"(?<![A-Za-z0-9_])_?(?:FABRIC|EDT)_[A-Z0-9_]*[A-Z0-9]")


def sources() -> Iterator[tuple[str, str]]:
    """(path relative to the package, source) of every module, the IBM runtime modules included."""
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def environment_uses(source: str) -> EnvironmentUses | None:
    """The module's uses of the environment; None, without parsing it, where its text names none
    (a renamed import names them too): most modules, and parsing them all is most of these tests' time."""
    return EnvironmentUses(source) if "environ" in source or "getenv" in source else None


def _is_os(node: ast.AST, *attrs: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in attrs
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


class EnvironmentUses:
    """Every use of ``os.environ``/``os.getenv`` in one module, sorted into reads and environment building."""

    def __init__(self, source: str) -> None:
        self.tree = ast.parse(source)
        self.parents = {child: node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)}

    def uses(self) -> Iterator[ast.Attribute]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and _is_os(node, "environ", "environb", "getenv", "getenvb"):
                yield node

    def renamed_imports(self) -> list[int]:
        """Lines importing ``environ``/``getenv`` under a bare name, which this scan could not follow."""
        return [
            node.lineno
            for node in ast.walk(self.tree)
            if isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and {a.name for a in node.names} & {"environ", "environb", "getenv", "getenvb"}
        ]

    def builds(self, node: ast.AST) -> bool:
        """Whether ``node`` (an ``os.environ``) builds an environment rather than reads a setting."""
        parent = self.parents[node]
        if isinstance(parent, ast.Attribute) and parent.attr in BUILDERS:
            return True  # os.environ.setdefault(...), .pop, .update, .clear
        if isinstance(parent, ast.Subscript) and isinstance(parent.ctx, (ast.Store, ast.Del)):
            return True  # os.environ[NAME] = value; del os.environ[NAME]
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "dict":
            return True  # dict(os.environ, ...): a copy for a child
        if isinstance(parent, ast.Dict) and None in parent.keys:
            return True  # {**os.environ, ...}: a copy for a child
        return self._in_environ_assignment(node)  # os.environ[X] = ... os.environ.get(X) ...: extended for a child

    def _in_environ_assignment(self, node: ast.AST) -> bool:
        while not isinstance(node, ast.stmt):
            node = self.parents[node]
        return isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Subscript) and _is_os(t.value, "environ") for t in node.targets
        )

    def function_of(self, node: ast.AST) -> str:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node.name
        return "<module>"

    def literal_name(self, node: ast.AST) -> str | None:
        """The variable a read names literally: ``os.environ["X"]``, ``os.environ.get("X")``,
        ``os.getenv("X")``, ``"X" in os.environ``."""
        parent = self.parents[node]
        candidate: ast.AST | None = None
        if isinstance(parent, ast.Subscript):
            candidate = parent.slice
        elif isinstance(parent, ast.Call) and parent.func is node and parent.args:
            candidate = parent.args[0]  # os.getenv("X")
        elif isinstance(parent, ast.Attribute) and isinstance(self.parents.get(parent), ast.Call):
            call = self.parents[parent]
            candidate = call.args[0] if isinstance(call, ast.Call) and call.args else None  # os.environ.get("X")
        elif isinstance(parent, ast.Compare):
            candidate = parent.left  # "X" in os.environ
        if isinstance(candidate, ast.Constant) and isinstance(candidate.value, str):
            return candidate.value
        return None


def test_every_variable_the_package_names_or_reads_is_registered():
    unknown = []
    for rel, source in sources():
        for match in NAME.finditer(source):
            written, following = match.group(), source[match.end() : match.end() + 1]
            prefix = following == "_" and any(r.startswith(written + "_") for r in settings.REGISTRY)
            if written not in settings.REGISTRY and not prefix:  # a prefix is fine: FABRIC_MODEL_SNAPSHOT_*
                unknown.append(f"{rel}:{source.count(chr(10), 0, match.start()) + 1}: {written}")
        uses = environment_uses(source)
        for node in uses.uses() if uses is not None else ():
            read = None if uses.builds(node) else uses.literal_name(node)
            if read is not None and read not in settings.REGISTRY:
                unknown.append(f"{rel}:{node.lineno}: reads {read}")
    assert not unknown, "declare these in fabric_model/settings/registry.py:\n" + "\n".join(unknown)


def test_only_the_registry_reads_the_environment():
    reads = []
    for rel, source in sources():
        if rel == "settings/registry.py":
            continue
        uses = environment_uses(source)
        if uses is None:
            continue
        reads += [f"{rel}:{line}: imports os.environ/os.getenv by name" for line in uses.renamed_imports()]
        for node in uses.uses():
            if uses.builds(node) or (rel, uses.function_of(node)) in HANDED_ON:
                continue
            reads.append(f"{rel}:{node.lineno}: {source.splitlines()[node.lineno - 1].strip()}")
    hint = "read these through fabric_model.settings.registry (or build a child's environment):\n"
    assert not reads, hint + "\n".join(reads)


def test_the_configuration_page_is_what_the_registry_generates():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == settings.markdown(), "regenerate: python -m fabric_model.settings.registry > docs/configuration.md"
    for setting in settings.public():
        assert f"| `{setting.name}` |" in page
    for setting in settings.internal():
        assert f"| `{setting.name}` |" not in page  # named in the note only


@pytest.mark.parametrize(
    "setting, raw, accepted",
    [
        (settings.CPU_WORKERS, "many", "a positive integer"),
        (settings.WORKERS_PER_GPU, "0", "a positive integer"),
        (settings.PULL_FAILED_LIMITS, "3.5", "a positive integer"),
        (settings.START_TIMEOUT, "-5", "a positive number of seconds"),
        (settings.HEARTBEAT_TIMEOUT, "inf", "a positive number of seconds"),
        (settings.SNAPSHOT_STEPS, "-1", "a whole number of steps, 0 or more"),
        (settings.SNAPSHOT_SHARE, "nan", "below 1"),
        (settings.WARM_START, "sometimes", "one of '0', '1', 'fresh', 'fork', 'fork-always'"),
        (settings.CLUSTER, "slurm", "one of 'local', 'ray'"),
        (settings.KEEP_FREED_MEMORY, "yes", "1 (workers keep freed memory for their next step) or 0"),
        (settings.REPLACE_WORKERS, "false", "1 or 0"),
        (settings.RAY_ACTOR_OPTIONS, "[1]", "a JSON object of Ray actor options"),
        (settings.RAY_ACTOR_OPTIONS, "{num_cpus: 4}", "a JSON object of Ray actor options"),
    ],
    ids=lambda value: value.name if isinstance(value, settings.Setting) else None,
)
def test_a_bad_value_fails_naming_the_variable_the_value_and_what_is_accepted(monkeypatch, setting, raw, accepted):
    name = setting.name
    monkeypatch.setenv(name, raw)
    for read in (setting.get, lambda: settings.get(name)):
        with pytest.raises(ValueError) as failure:
            read()
        assert str(failure.value) == f"Expected {name} to be {setting.accepted}. Received: {name}={raw!r}"
    assert accepted in setting.accepted


def test_the_callers_bounds_fail_on_a_bad_value_before_any_worker_starts(monkeypatch):
    monkeypatch.setenv("EDT_RECOVERY_TIME_OUT", "soon")
    with pytest.raises(ValueError, match=r"EDT_RECOVERY_TIME_OUT to be a positive number of seconds.*'soon'"):
        Timeouts.from_environment()
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SECONDS", "-1")
    with pytest.raises(ValueError, match=r"FABRIC_MODEL_SNAPSHOT_SECONDS to be a number of seconds, 0 or more"):
        SnapshotCadence.from_environment()


def test_unset_or_blank_means_the_default_and_values_are_parsed(monkeypatch):
    monkeypatch.delenv("EDT_START_TIME_OUT", raising=False)
    assert settings.START_TIMEOUT.get() == 120.0 and not settings.START_TIMEOUT.is_set()
    monkeypatch.setenv("EDT_START_TIME_OUT", "  ")
    assert settings.START_TIMEOUT.get() == 120.0
    monkeypatch.setenv("EDT_START_TIME_OUT", "7.5")
    assert settings.get("EDT_START_TIME_OUT") == 7.5
    monkeypatch.setenv("FABRIC_MODEL_CLUSTER", " Ray ")
    assert settings.CLUSTER.get() == "ray"
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")
    assert Timeouts.from_environment().replace_workers is False
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a value: no GPU
    assert settings.CUDA_VISIBLE.get() == "" and settings.CUDA_VISIBLE.is_set()
    with pytest.raises(KeyError, match="NOT_A_SETTING"):
        settings.get("NOT_A_SETTING")


def test_every_public_setting_has_a_doc_line_and_names_follow_the_internal_prefix_rule():
    assert settings.public() and settings.internal()
    for setting in settings.REGISTRY.values():
        assert setting.accepted, setting.name
        assert setting.internal == setting.name.startswith(settings.INTERNAL_PREFIX), setting.name
        assert setting.internal or not setting.name.startswith("_"), setting.name
    for setting in settings.public():
        doc = setting.doc
        assert doc.strip() and "\n" not in doc and "|" not in doc and doc.endswith("."), setting.name
    for ibm in ("EDT_START_TIME_OUT", "EDT_REPLACE_WORKERS", "RESULT_DIR", "LOG_DIR", "FABRIC_HOME", "DATA_DIR"):
        assert not settings.setting(ibm).internal  # users' scripts set IBM's names as IBM spelled them


def test_declare_refuses_a_name_against_the_rule_or_declared_twice():
    internal = settings.Setting("FABRIC_MODEL_X", False, bool, "1 or 0", "x.", internal=True)
    with pytest.raises(ValueError, match=r"internal setting's name to start with '_FABRIC_MODEL_'.*FABRIC_MODEL_X"):
        settings.declare(internal)
    with pytest.raises(ValueError, match=r"public setting's name to not start with '_'"):
        settings.declare(settings.Setting("_X", None, str, "text", "x."))
    with pytest.raises(ValueError, match="declared twice"):
        settings.declare(settings.CPU_WORKERS)


def test_the_registry_imports_the_standard_library_only():
    """``import fabric_model`` must stay free of torch: the registry is imported everywhere."""
    tree = ast.parse(REGISTRY_FILE.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    assert {m.split(".")[0] for m in modules} - {"__future__"} <= set(sys.stdlib_module_names)


def test_an_nccl_worker_keeps_the_watchdog_from_ending_it_unless_the_user_chose():
    """Torch's default NCCL watchdog ends the process on a timeout or a peer's error, which would
    take a survivor down with the peer it lost (transport/nccl.py): a worker sets the handling
    off where unset, keeps the user's choice, and gives the watchdog a timeout past its own."""
    from datetime import timedelta

    from fabric_model.transport import nccl

    env = {"TORCH_NCCL_ENABLE_MONITORING": "1"}
    chosen = nccl.prepare(env)
    expected = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    }
    assert env == chosen == expected  # monitoring: the user's
    assert nccl.watchdog_timeout(timedelta(seconds=30)) > timedelta(seconds=30)
