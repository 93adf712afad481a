"""The README is the front door and docs/ the manual: every page of the manual is linked from
the README, and every relative link in the README, the manual and tests/README.md leads to a
file that exists and, where it names a heading (`page.md#heading`), to a heading that exists.
A page moved or renamed, or a heading reworded, cannot leave a link pointing nowhere."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [ROOT / "README.md", *PAGES, ROOT / "tests/README.md"]
# [text](target) and ![alt](target), the target up to a space or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(?: {4}|\t).*$", re.M)  # indented code: `[a](b)` there is not a link


def links(document: Path) -> list[str]:
    text = FENCE.sub("", document.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link either
    return LINK.findall(text)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores
    kept), each space a hyphen (github/cmark-gfm's and github-slugger's rule)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(document: Path) -> set[str]:
    text = FENCE.sub("", document.read_text())
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_the_anchor_of_a_heading_is_githubs():
    assert (
        anchor("BACKEND = emulated: check a SageMaker configuration without AWS")
        == "backend--emulated-check-a-sagemaker-configuration-without-aws"
    )
    assert anchor("`smpipe init`'s sample") == "smpipe-inits-sample"
    assert anchor("Speed against peers (`make bench`)") == "speed-against-peers-make-bench"


def test_every_page_of_the_manual_is_linked_from_the_readme():
    linked = {
        (ROOT / target.split("#")[0]).resolve()
        for target in links(ROOT / "README.md")
        if not re.match(r"\w+:", target)
    }
    assert len(PAGES) >= 8
    assert [page.name for page in PAGES if page.resolve() not in linked] == []


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for document in DOCUMENTS:
        for target in links(document):
            if re.match(r"\w+:", target):  # https:, mailto: and the like
                continue
            path, _, heading = target.partition("#")
            file = (document.parent / path).resolve() if path else document
            if not file.exists():
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such file)")
            elif heading and file.suffix == ".md" and heading not in anchors(file):
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_opens_with_the_two_commands_and_make_has_them():
    """A fresh machine needs nothing else: `make run` installs what is missing, then runs the
    demo; `make test` the suite. They come first, before any figure."""
    first = (ROOT / "README.md").read_text().split("\n\n")[1].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run: install$", makefile, re.M)
    assert re.search(r"^test: install", makefile, re.M)


def test_every_image_build_the_project_runs_or_tells_of_is_for_sagemakers_x86():
    """An engine on Apple Silicon builds (and pulls) arm64 unless told, an image SageMaker's x86
    instances cannot run: `make image` and every build command a page or the Dockerfile shows
    ask for linux/amd64."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^PLATFORM \?= linux/amd64$", makefile, re.M)
    engine = [
        line for line in makefile.splitlines() if re.search(r"\$\(ENGINE\) (build|pull)", line)
    ]
    assert engine and all("--platform $(PLATFORM)" in line for line in engine), engine
    shown = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in [*DOCUMENTS, ROOT / "docker/Dockerfile"]
        for line in path.read_text().splitlines()
        if re.search(r"\b(docker|podman) build\b", line)
    ]
    assert shown and all("--platform linux/amd64" in line for line in shown), shown


def test_the_docs_and_code_speak_of_what_is_not_of_the_projects_history():
    """A reader cannot know what "issue 29" or "the fourth cuts" meant: a figure keeps its date
    and machine, a rule says why, never which round of work brought it."""
    history = re.compile(r"issue [0-9]|cuts", re.IGNORECASE)
    places = [ROOT / "README.md"] + [
        p
        for top in ("docs", "bench", "pipeline", "steps")
        for p in (ROOT / top).rglob("*")
        if p.is_file() and p.suffix in (".md", ".py", ".j2", ".sh", ".txt")
    ]
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in places
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if history.search(line)
    ]
    assert found == []
