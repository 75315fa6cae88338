"""The README and docs/ stay true: links resolve, named repo paths exist, the README's shell commands
are ones a test runs, docs/layout.md names every module, and every Python example runs.

Python examples marked ``<!-- needs: server -->`` on the line before their fence need a running
server; ``tests/integration/test_docs_examples.py`` runs them (and the README's curl example) against
one. No Ray here: the offline examples run in a subprocess of the venv's Python.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
NEEDS_SERVER = "<!-- needs: server -->"

# Every shell command of the README's quick start and deployment table -> (the test file that runs
# it, what that file must contain: the command's essential part as the test spells it).
README_COMMANDS: dict[str, tuple[str, str]] = {
    # `make serve` runs `mmserve serve` (checked against the Makefile below), which this test starts
    # as `python -m cluster.cli serve` (`mmserve` is `cluster.cli:main`) and drains with SIGTERM.
    "make serve": ("tests/integration/test_graceful_drain.py", '"cluster.cli", "serve"'),
    # `make test` is the whole suite after lint; this file checks its Makefile recipe.
    "make test": ("tests/unit/docs/test_docs.py", "def test_make_targets_run_what_the_readme_says"),
    ".venv/bin/mmserve serve": ("tests/integration/test_graceful_drain.py", '"cluster.cli", "serve"'),
    'IMG=$(.venv/bin/python -c "import base64,io;from PIL import Image;b=io.BytesIO();'
    "Image.new('RGB',(64,48),'red').save(b,'PNG');print(base64.b64encode(b.getvalue()).decode())\")": (
        "tests/integration/test_docs_examples.py",
        "def test_readme_curl_example",
    ),
    "curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{": (
        "tests/integration/test_docs_examples.py",
        "def test_readme_curl_example",
    ),
    # The cluster's commands run through cluster.bench.local_cluster.LocalRayCluster (checked below).
    "ray start --head --num-cpus=4": ("tests/integration/test_deploy_cli.py", "cluster.start_head("),
    "serve deploy cluster/deploy/serve-cpu.yaml": (
        "tests/integration/test_deploy_cli.py",
        "cluster/deploy/serve-cpu.yaml",
    ),
    "serve status": ("tests/integration/test_deploy_cli.py", "cluster.serve_status()"),
    "serve shutdown -y && ray stop": ("tests/integration/test_deploy_cli.py", "cluster.shutdown_serve()"),
    "helm install mmserve helm/mmserve -f helm/mmserve/values-gpu-example.yaml -n ml": (
        "tests/integration/deploy/test_helm_chart.py",
        '"values-gpu-example.yaml"',
    ),
}
# What LocalRayCluster runs for the test above, as the README spells it.
LOCAL_CLUSTER_CALLS = (
    '"ray",\n            "start"',
    '"serve", "deploy"',
    '"serve", "status"',
    '"serve", "shutdown", "-y"',
)

# Paths that name another project's files, not this repository's.
EXTERNAL_PATHS = {"ray/serve/_private/replica.py", "torchvision/ops/roi_align.py"}
FILE_SUFFIXES = (".py", ".yaml", ".yml", ".md", ".json", ".toml", ".txt", ".png", ".sh", ".tpl", ".cfg")


def _without_fences(text: str) -> str:
    """The page with every fenced block's lines blanked (line numbers kept)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def _fenced_blocks(path: Path, lang: str) -> list[tuple[int, str, bool]]:
    """(line number, code, marked as needing a server) of every ```lang block of a page."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == f"```{lang}":
            start, body = i, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            marked = start > 0 and lines[start - 1].strip() == NEEDS_SERVER
            blocks.append((start + 1, "\n".join(body) + "\n", marked))
        i += 1
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _without_fences(path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def _links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", _without_fences(path.read_text()))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


def _broken_links(path: Path) -> list[str]:
    broken = []
    for target in _links(path):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_points_at_an_existing_file_and_heading(page: Path) -> None:
    assert not _broken_links(page)


@functools.cache
def _repo_files() -> tuple[str, ...]:
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        listed = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]
    return tuple(listed)


def _named_paths(path: Path) -> list[str]:
    """Repo-path-looking code spans of a page: `router/http/chat.py`, `cluster/deploy/`, `media/fetch.py: f`."""
    found = []
    for span in re.findall(r"`([^`\n]+)`", _without_fences(path.read_text())):
        for word in span.split():
            token = word.rstrip(":,;.)")
            if "/" not in token or token.startswith(("/", "../", "~", "http")):
                continue
            if not re.fullmatch(r"[\w.\-/]+", token):
                continue
            first = token.split("/")[0]
            from_root = first not in (".", "..") and (ROOT / first).exists()
            if from_root or token.endswith(FILE_SUFFIXES):
                found.append(token)
    return found


def _missing_paths(path: Path) -> list[str]:
    files = _repo_files()
    missing = []
    for token in _named_paths(path):
        if token in EXTERNAL_PATHS or (ROOT / token).exists():
            continue
        if (ROOT / token.split("/")[0]).exists():
            missing.append(token)  # a path from the repo's root: it must be there
        elif not any(f == token or f.endswith("/" + token) for f in files):
            missing.append(token)  # a path inside a package, named from the package
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repo_path_the_page_names_exists(page: Path) -> None:
    assert not _missing_paths(page)


def test_path_check_is_not_vacuous() -> None:
    named = {t for p in PAGES for t in _named_paths(p)}
    assert {
        "router/http/sse.py",
        "cluster/deploy/serve-cpu.yaml",
        "mmcore/wire.py",
        "media/fetch.py",
    } <= named
    assert len(named) > 100


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def readme_commands() -> set[str]:
    """Each command of the README's quick start (a line of a ```bash block that is not a comment or a
    continuation, its trailing comment dropped) and of the deployment table's commands column."""
    text = README.read_text()
    found = set()
    quick = _section(text, "Quick start")
    for block in re.findall(r"```bash\n(.*?)```", quick, re.S):
        for line in block.splitlines():
            if line and not line[0].isspace() and not line.startswith("#"):
                found.add(re.sub(r"\s+#.*$", "", line).strip())
    for row in _section(text, "Deployments").splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if (
            row.startswith("|")
            and len(cells) == 3
            and not set(cells[1]) <= set(":- ")
            and cells[1] != "commands"
        ):
            found |= {c for c in re.findall(r"`([^`]+)`", cells[1]) if not c.startswith("--")}
    return found


def test_every_readme_command_is_run_by_a_test() -> None:
    assert readme_commands() == set(README_COMMANDS)
    for command, (test_file, essential) in README_COMMANDS.items():
        assert essential in (ROOT / test_file).read_text(), (command, test_file, essential)
    local_cluster = (ROOT / "cluster/bench/local_cluster.py").read_text()
    for call in LOCAL_CLUSTER_CALLS:
        assert call in local_cluster, call


def test_make_targets_run_what_the_readme_says() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve: setup\n\t\$\(VENV\)/bin/mmserve serve$", makefile, re.M)
    assert re.search(r"^test: lint\n\t\$\(PY\) -m pytest .* tests;", makefile, re.M)
    assert re.search(r"^test-fast: lint\n\t\$\(PY\) -m pytest .* -m \"not slow\" tests/unit;", makefile, re.M)
    assert 'mmserve = "cluster.cli:main"' in (ROOT / "pyproject.toml").read_text()


def _layout_rows() -> list[tuple[str, str, str]]:
    """(package, the row's first cell, its description) of every module row of docs/layout.md."""
    rows, package = [], ""
    for line in (ROOT / "docs/layout.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| module") or line.startswith("|---"):
            continue
        first, description = (c.strip() for c in line.strip().strip("|").split("|", 1))
        header = re.fullmatch(r"\*\*`?([^`*]+)`?\*\*", first)
        if header:
            package = header.group(1) if header.group(1).endswith("/") else ""
        elif package:
            rows.append((package, first, description))
    return rows


def test_layout_names_every_module_and_only_modules_that_exist() -> None:
    listed: set[str] = set()
    for package, first, description in _layout_rows():
        names = re.findall(r"`([^`]+)`", first)
        for name in names:
            assert (ROOT / package / name).exists(), f"docs/layout.md names {package}{name}"
            listed.add(package + name)
        if names and names[0].endswith("/"):  # a folder's row names its modules in the description
            for name in re.findall(r"`([\w/]+\.py)`", description):
                listed.add(package + names[0] + name)
    tracked = [f for f in _repo_files() if f.endswith(".py") and not f.startswith(("tests/", "docs/"))]
    unlisted = [f for f in tracked if "/" in f and not f.endswith("__init__.py") and f not in listed]
    assert not unlisted, f"modules docs/layout.md does not name: {unlisted}"


def _python_examples() -> list[tuple[str, str, bool]]:
    return [
        (f"{page.name}:{line}", code, marked)
        for page in PAGES
        for line, code, marked in _fenced_blocks(page, "python")
    ]


def test_the_docs_have_python_examples_of_both_kinds() -> None:
    kinds = {marked for _, _, marked in _python_examples()}
    assert kinds == {True, False}


@pytest.mark.parametrize(
    "where,code",
    [  # an example that builds a tiny model takes over 10 s
        pytest.param(w, c, marks=[pytest.mark.slow] if "make_tiny_model(" in c else [])
        for w, c, marked in _python_examples()
        if not marked
    ],
    ids=lambda v: v if ":" in v else "",
)
def test_python_example_runs(where: str, code: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"


def test_link_check_is_not_vacuous(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text(
        "[ok](there.md#a-heading) [gone](missing.md) [bad anchor](there.md#nope)\n"
        "```\n[in a fence](missing-too.md)\n```\n`[in a span](missing-three.md)`\n"
    )
    assert _broken_links(page) == [
        "missing.md: no such file",
        "there.md#nope: no heading with that anchor in there.md",
    ]
    assert slug("Against vLLM 0.32: `python -m cluster.bench.vs_vllm`") == (
        "against-vllm-032-python--m-clusterbenchvs_vllm"
    )
