"""No code outside a step strategy or a state layout branches on the mode (docs/architecture.md,
"Adding a step mode", "Adding a state layout").

The torch step's modes (lone, replicated, custom, deterministic sums) are classes in
``frameworks/torch/steps/``, chosen by one function; the optimizer state's layouts (replicated,
sharded) are classes in ``state/layouts.py``. A new mode that went in as a flag read in the step
path, the worker's loop, the state or the driver would be a condition on one of the names below:
this scans every condition (``if``, ``while``, a conditional expression, ``and``/``or``, a
comprehension's ``if``) in those packages. The few places that must look at an option before
any strategy exists are listed, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fabric_model"

#: Where modes are chosen and run: their conditions are theirs.
OWNERS = ("frameworks/torch/steps/", "state/layouts.py")

#: What is scanned: the torch step path, the worker's loop, the state and the driver.
SCANNED = ("frameworks/torch/", "worker/", "state/", "driver/")

#: Names whose test in a condition is a branch on a step mode or a state layout: the options
#: (``step_fn``, ``summing``, ``deterministic``, ``shard_optimizer_state``), how the state is
#: held (``sharded``, ``held_optimizer``, ``sliced_params``), the strategies' own state, and the
#: flags the step path had before it had strategies.
MODE_NAMES = frozenset(
    {
        "step_fn",
        "summing",
        "deterministic",
        "shard_optimizer_state",
        "sharded",
        "held_optimizer",
        "sliced_params",
        "transient",
        "fresh",
        "overlap",
        "gathers",
        "buffers_in_place",
        "_direct",
        "_py_sums",
        "_overlap",
        "_transient",
        "lone_direct",
        "whole_step_buffers_in_place",
    }
)

#: (module, function) -> why it may look at an option.
ALLOWED = {
    ("frameworks/torch/adapter.py", "TorchAdapter.__init__"): "a custom step reports (metric, loss): no default "
    "accuracy is added for it; the stats' names, before any step",
    ("frameworks/torch/adapter.py", "TorchAdapter._name_stats"): "the stats' names a custom step reports",
    ("frameworks/torch/adapter.py", "TorchAdapter.drop_default_accuracy"): "the same, in the caller",
    ("frameworks/torch/evaluation.py", "TorchEvaluation._evaluate_batch"): "evaluation, not the step: a custom "
    "step's test reports its (loss, metric) pair",
    ("frameworks/torch/framework.py", "TorchFramework.prepare_for_shipping"): "the caller's first-batch check: "
    "a custom step uses the loss its own way",
    ("frameworks/torch/framework.py", "TorchFramework.deterministic"): "deterministic=True's sum chosen once in "
    "the caller, from the run's configuration: the adapter's class",
    ("frameworks/torch/ordered.py", "OrderedTorchAdapter.from_adapter"): "refuses what the ordered sum cannot take",
}


def conditions(tree: ast.AST) -> list[tuple[str, ast.expr]]:
    """Every condition in ``tree`` with the qualified name of the function it is in."""
    found: list[tuple[str, ast.expr]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            found.append((".".join(scope), node.test))
        elif isinstance(node, ast.BoolOp):
            found.append((".".join(scope), node))
        elif isinstance(node, ast.comprehension):
            found.extend((".".join(scope), condition) for condition in node.ifs)
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return found


def names_in(expr: ast.expr) -> set[str]:
    """Attribute and variable names, and string constants (``getattr(x, "step_fn")``), in ``expr``."""
    names: set[str] = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def branches_on_modes() -> dict[tuple[str, str], set[str]]:
    """(module, function) -> the mode names its conditions read, outside the owners."""
    found: dict[tuple[str, str], set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if not module.startswith(SCANNED) or module.startswith(OWNERS):
            continue
        for function, condition in conditions(ast.parse(path.read_text(encoding="utf-8"))):
            read = names_in(condition) & MODE_NAMES
            if read:
                found.setdefault((module, function), set()).update(read)
    return found


def test_no_code_outside_a_strategy_or_layout_branches_on_the_mode() -> None:
    branches = branches_on_modes()
    unexplained = {where: sorted(names) for where, names in branches.items() if where not in ALLOWED}
    assert not unexplained, (
        "a condition on a step mode or state layout outside frameworks/torch/steps/ and state/layouts.py: "
        f"{unexplained}. Make the mode a class behind its extension point (see this module's docstring), "
        "or list it in ALLOWED with the reason."
    )
    stale = sorted(set(ALLOWED) - set(branches))
    assert not stale, f"ALLOWED lists places that no longer branch on a mode: {stale}"


def test_the_scan_sees_a_flag_where_it_would_be_read() -> None:
    """The scan itself: a sharded flag read in a loop's method is found, as the old loop read it."""
    source = (
        "class Loop:\n"
        "    def enter(self):\n"
        "        if self.sharded:\n"
        "            pass\n"
        "        x = [p for p in ps if not self.adapter._direct]\n"
        "        return getattr(self, 'step_fn', None) is None or y\n"
    )
    found = conditions(ast.parse(source))
    assert {function for function, _ in found} == {"Loop.enter"}
    assert set().union(*(names_in(c) & MODE_NAMES for _, c in found)) == {"sharded", "_direct", "step_fn"}
