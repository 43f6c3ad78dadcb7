"""The documentation a newcomer reads holds together: the README stays short and its
commands are the ones the Makefile and CI run; every link between the pages (and to
files of the repository, and to headings) resolves; every raw result file a page cites
exists; the pages speak of the software, not of the work tracker."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.S)


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(rel: str) -> set[str]:
    body = CODE.sub("", _read(rel))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", body, re.M)}


def test_readme_is_short_and_its_commands_are_the_ones_that_run():
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 200
    assert "make demo" in readme and "make test" in readme
    makefile = _read("Makefile")
    assert re.search(r"^demo:.*\n\t.*examples/ab_overlap\.py", makefile, re.M)
    assert re.search(r"^test:.*\n\t.*pytest.* tests$", makefile, re.M)
    assert re.search(r"^make test$", _read(".ci/run"), re.M)  # CI runs the README's command
    for topic in ("settings.md", "backends.md", "reliability.md", "tools.md", "megatron-lm.md",
                  "results.md"):
        assert f"docs/{topic}" in readme, topic


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    here = os.path.dirname(page)
    bad = []
    for target in LINK.findall(CODE.sub("", _read(page))):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        rel = os.path.normpath(os.path.join(here, path)) if path else page
        if not os.path.exists(os.path.join(ROOT, rel)):
            bad.append(f"{target}: no {rel}")
        elif anchor and rel.endswith(".md") and anchor not in _anchors(rel):
            bad.append(f"{target}: no heading #{anchor} in {rel}")
    assert not bad, bad


@pytest.mark.parametrize("page", PAGES)
def test_cited_result_files_exist(page):
    missing = []
    # prose citations; a command in a code block names its outputs as it was typed
    for cited in re.findall(r"benchmarks/results/[\w./{},*-]+", CODE.sub("", _read(page))):
        cited = cited.rstrip(".,")
        m = re.search(r"\{([^}]*)\}", cited)
        names = ([cited[:m.start()] + alt + cited[m.end():] for alt in m.group(1).split(",")]
                 if m else [cited])
        for name in names:
            if not glob.glob(os.path.join(ROOT, name)):
                missing.append(name)
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES)
def test_pages_speak_of_the_software(page):
    text = _read(page)
    assert not re.findall(r"\b(?:issue|deliverable) #?\d+", text, re.I), page
