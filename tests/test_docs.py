"""The documents: the README's example runs as pasted, every documentation citation points at a
file and a heading that exist, and the README stays short enough to read in five minutes.

Code cites the docs as ``docs/<page>.md, "<Section>"`` (several quoted sections allowed, joined
by commas or "and"; a name may run over a line break of a comment or docstring) and as
``docs/<page>.md#<anchor>``; markdown files link as ``[text](<page>.md#<anchor>)``. A section
exists when a heading's text equals the quoted name; an anchor exists when a heading's GitHub
slug equals it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from .helpers import need

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 200
CODE_DIRS = ("fabric_model", "tests", "benchmarks", "samples")
EXAMPLE_TIMEOUT = 180  # seconds; the example takes about 5 on 2 idle cores

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# A cited file, then one or more quoted section names: `docs/x.md, "A", "B" and "C"`.
CITED_FILE = r"(?P<file>docs/[\w.-]+\.md|benchmarks/README\.md|README(?:\.md)?(?:'s)?)"
QUOTED = r'"[^"\n]+"'
SECTION_CITATION = re.compile(CITED_FILE + r",?\s+(?P<names>" + QUOTED + r"(?:\s*(?:,|and)\s*" + QUOTED + r")*)")
ANCHOR_CITATION = re.compile(r"(?P<file>docs/[\w.-]+\.md|benchmarks/README\.md|README\.md)#(?P<anchor>[\w-]+)")
FILE_MENTION = re.compile(r"(?<![\w/.-])(?P<file>docs/[\w.-]+\.md|benchmarks/README\.md)")
MARKDOWN_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def markdown_files() -> list[Path]:
    return [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_files() -> list[Path]:
    """The code that may cite the docs; this file's strings are patterns, not citations."""
    return [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py")) if p != Path(__file__).resolve()]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a markdown file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def github_slug(text: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation other than
    ``-`` and ``_`` removed, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def headings(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(heading texts, anchors) of a markdown file; repeated slugs get -1, -2, ... as on GitHub."""
    texts, anchors, seen = set(), set(), {}
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        text = match.group(2)
        texts.add(text)
        texts.add(text.replace("`", ""))
        slug = github_slug(text)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(texts), frozenset(anchors)


def flattened(path: Path) -> tuple[str, list[int]]:
    """A file's text with its lines joined by one space, comment markers and indentation
    dropped (so a cited name may run over a line break), and each line's start offset."""
    parts, starts, offset = [], [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        text = re.sub(r"^\s*#*", "", line).strip() if path.suffix == ".py" else line.strip()
        starts.append(offset)
        parts.append(text)
        offset += len(text) + 1
    return " ".join(parts), starts


def line_of(starts: list[int], offset: int) -> int:
    return sum(1 for start in starts if start <= offset)


def cited_path(name: str) -> Path:
    return README if name.startswith("README") else ROOT / name


def check_text(path: Path) -> list[str]:
    """Every citation in one file whose file, section or anchor does not exist."""
    text, starts = flattened(path)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    broken = []
    for match in SECTION_CITATION.finditer(text):
        target = cited_path(match["file"])
        line = line_of(starts, match.start())
        if not target.is_file():
            broken.append(f"{where}:{line}: {match['file']} does not exist")
            continue
        texts, _ = headings(target)
        for name in re.findall(QUOTED, match["names"]):
            if " ".join(name.strip('"').split()) not in texts:
                rel = target.relative_to(ROOT)
                broken.append(f"{where}:{line}: {rel} has no section {name}")
    for match in ANCHOR_CITATION.finditer(text):
        target = cited_path(match["file"])
        line = line_of(starts, match.start())
        if not target.is_file():
            broken.append(f"{where}:{line}: {match['file']} does not exist")
        elif match["anchor"] not in headings(target)[1]:
            broken.append(f"{where}:{line}: {match['file']} has no heading with anchor #{match['anchor']}")
    for match in FILE_MENTION.finditer(text):
        if not (ROOT / match["file"]).is_file():
            broken.append(f"{where}:{line_of(starts, match.start())}: {match['file']} does not exist")
    return broken


def check_markdown_links(path: Path) -> list[str]:
    """Every relative link of a markdown file whose file or heading does not exist."""
    where = path.relative_to(ROOT)
    broken = []
    for number, line in prose_lines(path):
        for match in MARKDOWN_LINK.finditer(line):
            target = match["target"]
            if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{where}:{number}: link to {target}: {file} does not exist")
            elif anchor and resolved.suffix == ".md" and anchor not in headings(resolved)[1]:
                broken.append(f"{where}:{number}: link to {target}: no heading with anchor #{anchor}")
    return broken


def test_every_documentation_citation_exists():
    broken = [b for path in code_files() + markdown_files() for b in check_text(path)]
    broken += [b for path in markdown_files() for b in check_markdown_links(path)]
    assert not broken, "broken documentation citations:\n" + "\n".join(broken)


def test_the_citation_checker_finds_what_it_should(tmp_path):
    """The patterns above match the forms the code uses, across a comment's line break."""
    text = (
        '# see (docs/architecture.md, "What a step costs\n'
        '#   beyond the math") and docs/architecture.md, "Processes" and "Nope"\n'
        '"""docs/architecture.md,\n    "Elasticity", "No such"; docs/architecture.md#no-anchor"""\n'
    )
    sample = tmp_path / "sample.py"
    sample.write_text(text, encoding="utf-8")
    broken = check_text(sample)
    assert [b.split(": ", 1)[1] for b in broken] == [  # "What a step costs beyond the math" exists
        'docs/architecture.md has no section "Nope"',
        'docs/architecture.md has no section "No such"',
        "docs/architecture.md has no heading with anchor #no-anchor",
    ], broken
    assert github_slug("What you see: progress, logs, TensorBoard, the command line") == (
        "what-you-see-progress-logs-tensorboard-the-command-line"
    )
    assert github_slug("`logs/metrics.jsonl`") == "logsmetricsjsonl"
    assert github_slug("IBM's semantics in the library") == "ibms-semantics-in-the-library"


def test_architecture_lists_every_module():
    """docs/architecture.md's "Modules" table has one line for each module of the package, and none
    for a module that is gone."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", section, re.M))
    package = ROOT / "fabric_model"
    actual = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    assert not actual - listed, f'add to docs/architecture.md, "Modules": {sorted(actual - listed)}'
    assert not listed - actual, f"gone from fabric_model/, still in the Modules table: {sorted(listed - actual)}"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; keep it under {MAX_README_LINES}"


def readme_example() -> tuple[str, str]:
    """The README's first python block, and the last line of the output block after it."""
    text = README.read_text(encoding="utf-8")
    code = re.search(r"^```python\n(.*?)^```$", text, re.S | re.M)
    assert code, "README.md has no ```python block"
    output = re.search(r"^```\n(.*?)^```$", text[code.end() :], re.S | re.M)
    assert output, "README.md shows no output after its example"
    return code.group(1), output.group(1).strip().splitlines()[-1]


def run_example(code: str, tmp_path: Path) -> str:
    """``code`` run as a script in a fresh interpreter (its run directory in ``tmp_path``); its last line."""
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "RESULT_DIR": str(tmp_path / "run")}  # not ./fabric_runs of the repository
    done = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.processes
def test_readme_hugging_face_example_runs_as_pasted(tmp_path):
    """The README's second example, a GPT-2 on its own loss, prints the losses the README says it ends with."""
    need("transformers")
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)
    assert len(blocks) >= 2 and "transformers" in blocks[1], "README.md shows no Hugging Face example"
    said = re.search(r"It ends with `loss (\d+\.\d+) -> (\d+\.\d+)`", text)
    assert said, "the README should say what the Hugging Face example prints"
    last = run_example(blocks[1], tmp_path)
    printed = re.fullmatch(r"loss (\d+\.\d+) -> (\d+\.\d+)", last)
    assert printed, f"the example printed {last!r}"
    first, final = float(printed.group(1)), float(printed.group(2))
    assert final < first
    # Seeded: the figures repeat on one platform; another CPU may round differently.
    assert abs(first - float(said.group(1))) <= 0.05 and abs(final - float(said.group(2))) <= 0.05, (last, said[0])


@pytest.mark.processes
def test_readme_example_runs_as_pasted(tmp_path):
    code, key_line = readme_example()
    number = re.fullmatch(r"test accuracy (\d\.\d+)", key_line)
    assert number, f"the README's example output should end with its test accuracy, not {key_line!r}"
    last = run_example(code, tmp_path)
    printed = re.fullmatch(r"test accuracy (\d\.\d+)", last)
    assert printed, f"the example printed {last!r}; the README says {key_line!r}"
    # Seeded, so the figure repeats on one platform; another CPU may round one sample differently.
    assert abs(float(printed.group(1)) - float(number.group(1))) <= 0.02, (last, key_line)
