"""The package's layers (docs/architecture.md, "Layers"): the import-linter contract in
pyproject.toml holds, and the documentation lists the same layers in the same order. In-process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def contract() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return layers


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    # In a process of its own: the linter's command line owns the streams it writes to.
    check = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_contract_is_exhaustive_and_every_exception_says_why() -> None:
    layers = contract()
    assert layers["exhaustive"] is True  # a new folder must be given its place
    text = (ROOT / "pyproject.toml").read_text()
    for ignored in layers.get("ignore_imports", []):
        before = text[: text.index(f'"{ignored}"')].rstrip().splitlines()[-1].strip()
        assert before.startswith("#") or before.endswith('",'), f"{ignored}: no reason above it"


def test_the_documentation_lists_the_contracts_layers_in_order() -> None:
    doc = (ROOT / "docs/architecture.md").read_text()
    section = doc[doc.index("\n## Layers\n") : doc.index("\n## Modules\n")]
    rows = re.findall(r"^\| `.*$", section, re.M)
    documented = [re.sub(r"[`\\]", "", row.split(" | ")[0].strip("| ")) for row in rows]
    expected = [" | ".join(name.strip() for name in layer.split("|")) for layer in contract()["layers"]]
    assert documented == expected
