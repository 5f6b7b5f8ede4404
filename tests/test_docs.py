"""Every example in README.md and docs/ runs, so the documentation cannot rot.

Fenced blocks tagged ``python`` run with this interpreter; blocks tagged ``sh`` run with bash,
with the nsbox CLI on PATH, each in a fresh directory. A block right after an HTML comment
``<!-- ci: ... -->`` is run by .ci/run itself (installation), and one after
``<!-- no-test: reason -->`` is skipped with that reason. One after ``<!-- needs: curl -->``
runs the commands it names, which the Quick start does not install: without them it skips (and
fails in CI, as ``require`` does).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, require

BLOCK = re.compile(r"(?:<!-- (?P<tag>[^>]*) -->\s*)?```(?P<lang>python|sh)\n(?P<code>.*?)```",
                   re.S)


def examples() -> list[tuple[str, str, str, str | None]]:
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, match in enumerate(BLOCK.finditer(doc.read_text())):
            found.append((f"{doc.name}#{n}", match["lang"], match["code"], match["tag"]))
    return found


@pytest.mark.parametrize(("name", "lang", "code", "tag"), examples(),
                         ids=[e[0] for e in examples()])
def test_doc_example_runs(name: str, lang: str, code: str, tag: str | None, tmp_path: Path):
    if tag and tag.startswith("ci:"):
        pytest.skip(".ci/run runs this block itself")
    if tag and tag.startswith("no-test"):
        pytest.skip(tag)
    if tag and tag.startswith("needs:"):
        for tool in tag.removeprefix("needs:").split():
            require(shutil.which(tool) is not None,
                    f"{tool} is not installed (the example runs it)")
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(REPO))
    # Blocks run as if in a checkout set up by the Quick start: its `. .venv/bin/activate` puts
    # this environment's nsbox on PATH.
    activate = tmp_path / ".venv" / "bin" / "activate"
    activate.parent.mkdir(parents=True)
    activate.write_text(f'PATH="{bin_dir}:$PATH"\nexport PATH\n')
    argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail",
                                                                  "-c", code]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"{name} failed:\n{code}\n--- stderr:\n{proc.stderr}"


def test_the_architecture_names_every_module() -> None:
    """docs/architecture.md's module table has a row for every source file of the package (a
    row may name a header beside its .c file), and no row for a file that is gone."""
    text = (REPO / "docs" / "architecture.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `nsbox/")]
    named = set()
    for row in rows:
        first, *others = re.findall(r"`([^`]+)`", row.split("|")[1])
        named.add(first)
        named.update(str(Path(first).parent / other) for other in others)
    files = {str(p.relative_to(REPO)) for ext in ("py", "c", "h")
             for p in (REPO / "nsbox").rglob(f"*.{ext}")}
    assert sorted(files - named) == []
    assert sorted(named - files) == []


def test_the_texts_a_user_reads_cite_no_tracker_numbers() -> None:
    """The docs, the README and the bench's text and chart legends speak of nsbox alone: no
    "issue 12" or "#12" that a reader of a copy cannot look up."""
    cited = re.compile(r"\bissues? ?#?\d+|(?:^|[\s(])#\d+\b", re.I)
    files = [REPO / "README.md", *(REPO / "docs").glob("*.md"),
             *(REPO / "nsbox" / "bench").glob("*.py")]
    found = [f"{path.relative_to(REPO)}: {match[0].strip()}" for path in files
             for match in cited.finditer(path.read_text())]
    assert found == []
