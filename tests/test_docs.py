"""The documentation holds: every relative link in README.md, docs/ and the packages' READMEs
resolves (to a file, and to a heading where it names one), every fenced shell command that runs
elasticrun names only flags elasticrun has, every `make` target named exists, and the root
README stays a front door."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from elastic_launch.launcher.cli import get_args_parser

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [
        REPO / "README.md",
        REPO / "cpp" / "README.md",
        *REPO.glob("docs/*.md"),
        *REPO.glob("python/*/README.md"),
    ]
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    text = FENCE.sub("", text)  # a '#' in a code block is no heading
    found = {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}
    found |= set(re.findall(r'<a id="([^"]+)"', text))
    return found


def ids(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=ids)
def test_every_relative_link_resolves(page):
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check offline
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        assert where.exists(), f"{ids(page)}: '{target}' names no file"
        if anchor:
            assert where.suffix == ".md", f"{ids(page)}: '{target}': an anchor into a non-page"
            assert anchor in anchors(where), f"{ids(page)}: '{target}': no such heading"


def shell_commands(page: Path) -> list[str]:
    """The commands of a page's sh/bash/shell fences, one per logical line (continued lines
    joined, comments dropped)."""
    out = []
    for lang, body in FENCE.findall(page.read_text()):
        if lang not in ("sh", "bash", "shell", "console"):
            continue
        for raw in body.replace("\\\n", " ").splitlines():
            line = raw.strip().removeprefix("$ ")
            if line and not line.startswith("#"):
                out.append(line.split(" #")[0])
    return out


def elasticrun_flags() -> dict[str, bool]:
    """Every flag elasticrun takes, and whether it takes a value."""
    flags = {}
    for action in get_args_parser()._actions:
        for name in action.option_strings:
            flags[name] = action.nargs != 0
    return flags


@pytest.mark.parametrize("page", PAGES, ids=ids)
def test_every_shell_command_names_flags_that_exist(page):
    known = elasticrun_flags()
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for command in shell_commands(page):
        try:
            words = shlex.split(command)
        except ValueError:
            words = command.split()
        for i, word in enumerate(words):
            if word == "make":
                for target in words[i + 1 :]:
                    if target.startswith("-") or "=" in target:
                        continue
                    assert target in targets, f"{ids(page)}: `{command}`: no make target {target}"
                    break
            if word.endswith("elasticrun") and word != "elasticrun.sbatch":
                check_flags(words[i + 1 :], known, f"{ids(page)}: `{command}`")


def check_flags(words: list[str], known: dict[str, bool], where: str) -> None:
    """elasticrun's flags up to the script (what follows the script is the script's own)."""
    rest = iter(words)
    for word in rest:
        if not word.startswith("-"):
            return
        name, eq, _ = word.partition("=")
        assert name in known, f"{where}: elasticrun has no {name}"
        if known[name] and not eq:
            next(rest, None)  # its value


def test_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "the front door: at most 150 lines (docs/ for the rest)"
    assert text.count("make run") and text.count("make test")
    for page in ("launcher", "rendezvous", "checkpoints", "train_loop", "clusters", "core"):
        assert f"docs/{page}.md" in text, f"the README links no docs/{page}.md"


def test_every_docs_page_is_linked_from_the_readme():
    text = (REPO / "README.md").read_text()
    for page in REPO.glob("docs/*.md"):
        assert f"docs/{page.name}" in text, f"docs/{page.name} is not linked from the README"
