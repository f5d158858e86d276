"""The README's and docs/ pages' links to files of this repository, and to their sections, lead somewhere; the code
they show is there: their python blocks' imports import, every `lzero <command>` is one, every script, config and
`python -m` module a command names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_every_local_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and anchor not in anchors(file):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such section)")
    assert not broken, "\n".join(broken)


def test_readme_links_every_docs_page_and_stays_short() -> None:
    readme = (REPO / "README.md").read_text()
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(readme) if t.startswith("docs/")}
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
    assert len(readme.splitlines()) <= 120


# ---------------------------------------------------------------------------------- the code the pages show

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def code_blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line inside the page's fenced blocks of ``language``."""
    text = page.read_text()
    out = []
    for block in FENCE.finditer(text):
        if block.group(1) == language:
            first = text.count("\n", 0, block.start(2)) + 1
            out += [(first + i, line) for i, line in enumerate(block.group(2).splitlines())]
    return out


def import_statements(page: Path) -> list[tuple[int, str]]:
    """The ``import x`` / ``from x import y`` statements of the page's python blocks (a parenthesized one joined)."""
    out, lines = [], code_blocks(page, "python")
    i = 0
    while i < len(lines):
        number, line = lines[i]
        statement = line.split("#")[0].strip()
        if re.match(r"(import|from)\s+[\w.]+", statement):
            while statement.count("(") > statement.count(")") and i + 1 < len(lines):
                i += 1
                statement += " " + lines[i][1].split("#")[0].strip()
            out.append((number, statement))
        i += 1
    return out


def test_the_pages_python_imports_import() -> None:
    """Every import line the pages' code shows runs, in one fresh interpreter of this environment."""
    import json
    import subprocess
    import sys

    statements = [(f"{page.relative_to(REPO)}:{number}", line) for page in PAGES
                  for number, line in import_statements(page)]
    assert len(statements) >= 5, statements  # the pages show their imports; the check is not empty
    script = ("import json, sys\nfailed = []\n"
              "for where, line in json.loads(sys.argv[1]):\n"
              "    try:\n        exec(line, {})\n"
              "    except Exception as e:\n        failed.append(f'{where}: {line} -> {type(e).__name__}: {e}')\n"
              "print(json.dumps(failed))\n")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(statements)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(failed)


def shell_commands(page: Path) -> list[tuple[int, str]]:
    """``(line number, command)``: the lines of the page's bash blocks and its inline code, as a reader copies them."""
    out = [(n, line.split("#")[0].strip()) for n, line in code_blocks(page, "bash")]
    for number, line in enumerate(page.read_text().splitlines(), 1):
        out += [(number, span.strip()) for span in CODE_SPAN.findall(line)]
    return [(n, c) for n, c in out if c]


def test_the_pages_lzero_subcommands_exist() -> None:
    from lzero.cli import EXTRA_COMMANDS, LIGHTNING_COMMANDS

    known = {*LIGHTNING_COMMANDS, *EXTRA_COMMANDS}
    unknown = [f"{page.relative_to(REPO)}:{number}: {command}" for page in PAGES
               for number, command in shell_commands(page)
               for name in re.findall(r"(?:^|[\s/(])lzero ([a-z][\w-]*)", command) if name not in known]
    assert not unknown, "\n".join(unknown)


def test_the_pages_scripts_configs_and_modules_exist() -> None:
    """`python path.py`, `python -m module`, `--config configs/x.yaml`: each names something that is there."""
    import importlib.util

    missing = []
    for page in PAGES:
        for number, command in shell_commands(page):
            where = f"{page.relative_to(REPO)}:{number}: {command}"
            for path in re.findall(r"(?:^|\s)python\s+([\w./-]+\.py)\b", command):
                missing += [] if (REPO / path).is_file() else [f"{where} (no file {path})"]
            for config in re.findall(r"--config\s+(configs/[\w./-]+\.yaml)", command):
                missing += [] if (REPO / config).is_file() else [f"{where} (no file {config})"]
            for module in re.findall(r"(?:^|\s)python\s+-m\s+([\w.]+)", command):
                path = REPO / module.replace(".", "/")
                found = path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()
                missing += [] if found or importlib.util.find_spec(module) else [f"{where} (no module {module})"]
    assert not missing, "\n".join(missing)
