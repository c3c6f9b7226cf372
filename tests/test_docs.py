"""README.md and docs/*.md: every fenced code block runs as written.

A document is a script read top to bottom: its ```python blocks run in a fresh interpreter and its
```bash / ```sh / ```console blocks in bash, all in one temporary folder, in order, so a block may
read what an earlier block of the same document wrote and nothing else. The subprocesses get no
`XLA_FLAGS` (conftest.py sets it for this process): a block that needs several CPU devices must say
how it gets them. ```text, ```json and other languages are output or data, never run.

An HTML comment on the line right before a fence tags the block:

- `<!-- docs-test: slow -->` runs only under pytest's `slow` marker (a whole-document run);
- `<!-- docs-test: ci -->` is a command CI runs verbatim: the test checks that `.ci/run` holds it.

The package is installed here, so a shell block's leading `python -m pip install ... &&` is dropped.
"""

from __future__ import annotations

import enum
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
#: Seconds one block may run before the document fails (the fast blocks take a few seconds each).
BLOCK_TIMEOUT_SECONDS = 600

FENCE = re.compile(r"^```(\S*)\s*$")
TAG = re.compile(r"^<!--\s*docs-test:\s*(\w+)\s*-->\s*$")
INSTALL_PREFIX = re.compile(r"^python -m pip install [^&]*&&\s*")


class Language(enum.Enum):
    """How a fenced block is treated, by its info string."""

    PYTHON = "python"
    SHELL = "shell"
    CONSOLE = "console"
    NOT_RUN = "not run"

    @classmethod
    def of(cls, info: str) -> Language:
        return {"python": cls.PYTHON, "py": cls.PYTHON, "bash": cls.SHELL, "sh": cls.SHELL,
                "shell": cls.SHELL, "console": cls.CONSOLE}.get(info, cls.NOT_RUN)


class Tag(enum.Enum):
    """What the comment before a fence asks of the test."""

    NONE = "none"
    SLOW = "slow"
    CI = "ci"


@dataclass(frozen=True)
class Block:
    document: Path
    line: int  # of the opening fence, 1-based
    language: Language
    tag: Tag
    code: str

    @property
    def where(self) -> str:
        name = self.document.relative_to(ROOT) if self.document.is_relative_to(ROOT) else self.document.name
        return f"{name}:{self.line}"

    def script(self) -> str:
        """The code to run: console blocks keep their `$ ` lines; the install step is dropped."""
        code = self.code
        if self.language is Language.CONSOLE:
            code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))
        if self.language is not Language.PYTHON:
            code = "\n".join(INSTALL_PREFIX.sub("", line) for line in code.splitlines())
        return code + "\n"


class DocumentError(ValueError):
    """A malformed document: an unclosed fence or an unknown docs-test tag."""


def parse_tag(line: str, where: str) -> Tag:
    match = TAG.match(line.strip())
    if not match:
        return Tag.NONE
    try:
        return Tag(match.group(1))
    except ValueError:
        raise DocumentError(f"{where}: unknown docs-test tag {match.group(1)!r} "
                            f"(known: {', '.join(t.value for t in Tag if t is not Tag.NONE)})") from None


def extract_blocks(document: Path, text: str) -> list[Block]:
    """Every fenced block of a Markdown text, in order, with the tag on the line before it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start = i
        tag = parse_tag(lines[i - 1], f"{document.name}:{i}") if i else Tag.NONE
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if i == len(lines):
            raise DocumentError(f"{document.name}:{start + 1}: fence never closed")
        blocks.append(Block(document, start + 1, Language.of(match.group(1)), tag,
                            "\n".join(lines[start + 1:i])))
        i += 1
    return blocks


def runnable(blocks: list[Block], *, slow: bool) -> list[Block]:
    """The blocks a run executes: CI's commands never, slow ones only in the slow run."""
    return [b for b in blocks if b.language is not Language.NOT_RUN and b.tag is not Tag.CI
            and (slow or b.tag is not Tag.SLOW)]


def shim_bin(folder: Path) -> Path:
    """`python` and `hlomap` on PATH that run this interpreter with this checkout's package."""
    folder.mkdir()
    (folder / "python").symlink_to(sys.executable)
    hlomap = folder / "hlomap"
    hlomap.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "from hlomap.cli import main; main()" "$@"\n')
    hlomap.chmod(0o755)
    return folder


def environment(bin_dir: Path, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["HLOMAP_CACHE_DIR"] = str(cache)
    env["MPLBACKEND"] = "Agg"
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> None:
    if block.language is Language.PYTHON:
        command = [sys.executable, "-c", block.script()]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.script()]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False,
                            timeout=BLOCK_TIMEOUT_SECONDS)
    if result.returncode != 0:
        pytest.fail(f"the block at {block.where} exited with {result.returncode}:\n"
                    f"{block.script()}\n--- stdout (tail)\n{result.stdout[-3000:]}\n"
                    f"--- stderr (tail)\n{result.stderr[-3000:]}", pytrace=False)


def run_document(document: Path, tmp_path: Path, *, slow: bool) -> None:
    blocks = runnable(extract_blocks(document, document.read_text()), slow=slow)
    if not blocks:
        pytest.skip(f"{document.name} has no block for this run")
    work = tmp_path / "work"
    work.mkdir()
    env = environment(shim_bin(tmp_path / "bin"), tmp_path / "cache")
    for block in blocks:
        run_block(block, work, env)


def _ids(documents: tuple[Path, ...]) -> list[str]:
    return [str(d.relative_to(ROOT)) for d in documents]


@pytest.mark.parametrize("document", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_the_fast_blocks_of_a_document_run_in_order(document: Path, tmp_path: Path) -> None:
    run_document(document, tmp_path, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("document", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_every_block_of_a_document_runs_in_order(document: Path, tmp_path: Path) -> None:
    run_document(document, tmp_path, slow=True)


def test_ci_runs_each_ci_tagged_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    tagged = [b for d in DOCUMENTS for b in extract_blocks(d, d.read_text()) if b.tag is Tag.CI]
    assert tagged, "README's Quickstart test command is tagged docs-test: ci"
    for block in tagged:
        assert block.code.strip() in ci, f"{block.where}: .ci/run does not run {block.code.strip()!r}"


def test_the_readme_fits_on_a_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("document", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_a_document_links_only_what_a_clone_has(document: Path) -> None:
    """Relative links resolve inside the repository; nothing points beside the checkout (a
    user's clone has no ../shared) or at a tracker a user cannot read."""
    text = document.read_text()
    for target in re.findall(r"\]\(([^)#]*)", text):
        if target and "://" not in target:
            resolved = (document.parent / target).resolve()
            assert resolved.is_relative_to(ROOT) and resolved.exists(), \
                f"{document.relative_to(ROOT)} links {target}, which the repository lacks"
    assert "../shared" not in text and "issue tracker" not in text


def test_every_document_is_linked_from_the_readme() -> None:
    text = (ROOT / "README.md").read_text()
    for document in DOCUMENTS[1:]:
        assert f"docs/{document.name}" in text, f"README.md does not link docs/{document.name}"


def test_blocks_are_extracted_with_their_tags_and_languages(tmp_path: Path) -> None:
    text = ("# t\n\n<!-- docs-test: slow -->\n```python\nprint(1)\n```\n\n```text\nout\n```\n\n"
            "<!-- docs-test: ci -->\n```bash\npython -m pip install . && pytest\n```\n"
            "```console\n$ python -m pip install -e . && hlomap zoo list\noutput\n```\n")
    blocks = extract_blocks(tmp_path / "t.md", text)
    assert [(b.line, b.language, b.tag) for b in blocks] == [
        (4, Language.PYTHON, Tag.SLOW), (8, Language.NOT_RUN, Tag.NONE),
        (13, Language.SHELL, Tag.CI), (16, Language.CONSOLE, Tag.NONE)]
    assert blocks[2].script() == "pytest\n" and blocks[3].script() == "hlomap zoo list\n"
    assert runnable(blocks, slow=False) == [blocks[3]]
    assert runnable(blocks, slow=True) == [blocks[0], blocks[3]]


@pytest.mark.parametrize("text, message", [
    ("```python\nprint(1)\n", "fence never closed"),
    ("<!-- docs-test: sometimes -->\n```bash\ntrue\n```\n", "unknown docs-test tag 'sometimes'"),
])
def test_a_malformed_document_is_named_with_its_line(text: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match=message):
        extract_blocks(tmp_path / "t.md", text)


def test_a_failing_block_fails_the_document_naming_its_line(tmp_path: Path) -> None:
    document = tmp_path / "bad.md"
    document.write_text("```bash\ntouch made\n```\n\n```bash\ntest -f made && false\n```\n")
    blocks = runnable(extract_blocks(document, document.read_text()), slow=False)
    env = environment(shim_bin(tmp_path / "bin"), tmp_path / "cache")
    run_block(blocks[0], tmp_path, env)
    with pytest.raises(pytest.fail.Exception, match="bad.md:5 exited with 1"):
        run_block(blocks[1], tmp_path, env)
