"""The manual (docs/, mkdocs.yml) and the README as a spec: the site builds in strict mode, every
README link and anchor resolves, and every python code block runs.

A code block that cannot run in a test (S3 credentials, a Prefect server, a GPU, worker
processes) has `<!-- no-run: reason -->` on the line before its opening fence and is skipped
with that reason. Blocks run in this process, in a scratch folder where `data/` is the
repository's, so relative paths in them (`data/labelling.parquet`, `out/labels`) behave as in a
fresh checkout.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

FENCE = re.compile(r"^```(\w*)\s*$")
NO_RUN = re.compile(r"^<!--\s*no-run:\s*(.+?)\s*-->$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    no_run: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """Fenced code blocks of a Markdown file, with the no-run reason of the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.name}:{i + 1}: code block never closed")
        prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        reason = NO_RUN.match(prev)
        blocks.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n",
                            reason.group(1) if reason else None))
        i = j + 1
    return blocks


def prose(path: Path) -> str:
    """The file's text with its fenced code blocks blanked (links and headings inside code do not count)."""
    out, in_code = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
            out.append("")
            continue
        out.append("" if in_code else line)
    return "\n".join(out)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: inline code marks and links dropped, lower case, punctuation
    removed, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path).splitlines():
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_github_slug_matches_githubs_rules():
    assert github_slug("The host's matrix unit (dtype)") == "the-hosts-matrix-unit-dtype"
    assert github_slug("Job input/output") == "job-inputoutput"
    assert github_slug("More than one machine: a Dask cluster") == "more-than-one-machine-a-dask-cluster"
    assert github_slug("On a GPU (one H200)") == "on-a-gpu-one-h200"
    assert github_slug("`LLM.score` and friends") == "llmscore-and-friends"


def readme_links() -> list[str]:
    return LINK.findall(prose(README))


def test_readme_links_and_anchors_resolve():
    links = readme_links()
    assert len(links) >= 10, links  # the supported table alone links a page per row
    broken = []
    for target in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        rel, _, anchor = target.partition("#")
        dest = (README.parent / rel).resolve() if rel else README
        if not dest.exists():
            broken.append(f"{target}: {dest.relative_to(ROOT)} does not exist")
            continue
        if anchor:
            if dest.suffix != ".md":
                broken.append(f"{target}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(dest):
                broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_in_the_nav_and_linked_from_the_readme():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    linked = {t.partition("#")[0] for t in readme_links()}
    for page in PAGES:
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.M), f"{page.name} is not in mkdocs.yml's nav"
        assert f"docs/{page.name}" in linked, f"README does not link docs/{page.name}"


@pytest.mark.parametrize("path", [README, DOCS / "results.md"], ids=lambda p: p.name)
def test_the_results_block_has_its_markers_once_in_order(path):
    text = path.read_text(encoding="utf-8")
    assert text.count("<!-- results:begin -->") == 1 and text.count("<!-- results:end -->") == 1
    begin, end = text.index("<!-- results:begin -->"), text.index("<!-- results:end -->")
    assert begin < end
    if path == README:  # the headline table keeps its host line with it
        block = text[begin:end]
        assert "Host:" in block and "| workload |" in block


def test_the_readme_opens_with_what_it_is_the_two_commands_and_an_example():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250
    first_screen = "\n".join(lines[:60])
    for needle in ("offline batch LLM inference", "make demo", "make test", "from engine import LLM"):
        assert needle in first_screen, needle
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test", "docs", "bench"):
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no {target} target"
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _site_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, capture_output=True, text=True,
                          timeout=300)


def test_the_manual_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings_handlers.python")
    done = _site_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("engine.LLM", "EngineConfig", "SamplingParams", "run_job", "max_num_batched_tokens"):
        assert name in api, f"the API page does not document {name}"
    for page in PAGES:
        assert (tmp_path / "site" / (page.stem if page.stem != "index" else "") / "index.html").exists(), page.name


def test_a_broken_link_fails_the_strict_build(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "docs" / "api.md").write_text("# API reference\n", encoding="utf-8")  # no sources here
    with (tmp_path / "docs" / "job.md").open("a", encoding="utf-8") as f:
        f.write("\nSee [the engine](engine.md#no-such-heading).\n")
    done = _site_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-heading" in done.stdout + done.stderr


PYTHON_BLOCKS = [b for page in [README, *PAGES] for b in code_blocks(page) if b.lang == "python"]


def test_blocks_that_do_not_run_say_why():
    marked = [b for page in [README, *PAGES] for b in code_blocks(page) if b.no_run is not None]
    assert all(len(b.no_run) >= 8 for b in marked), [b.id for b in marked]
    assert len(PYTHON_BLOCKS) >= 10


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    (tmp_path / "data").symlink_to(ROOT / "data", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    return tmp_path


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_block_runs(block, scratch):
    if block.no_run is not None:
        pytest.skip(f"no-run: {block.no_run}")
    exec(compile(block.code, block.id, "exec"), {"__name__": "__docs__"})
