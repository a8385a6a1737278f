"""Every repository path the documents cite exists.

A cited path is a Markdown link or image target (relative, no URL), or an inline code span
outside fenced blocks (commands there write their own outputs) that looks like a path: no spaces,
and either a name ending in a source, document or result extension, or a "/" after the name of a
folder of the repository (`alpha/r` or `heads/K` are maths). `{a,b}` expands and `*` globs. It
exists when it names a file or folder of the repository from the root, from the document's folder,
or, written from a folder inside the tree (`runner/disco.py`, `ops/lora/sgmv.cu`), as the tail of
one. Files of other projects that the documents name are listed in EXTERNAL.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "adapters" / "README.md"]
EXTENSIONS = {".py", ".md", ".cc", ".h", ".c", ".cu", ".cuh", ".inc", ".sh", ".cmake", ".toml", ".log", ".svg",
              ".png", ".txt", ".out"}
SKIP_DIRS = {".git", ".venv", "build", ".dev", "__pycache__", "dist"}
# Other projects' files the documents cite, by the start of the citation.
EXTERNAL = {
    "tvm/": "apache-tvm's headers and Python sources",
    "_decode_kernels.py": "apache-tvm (tvm/relax/frontend/nn/llm/)",
    "cublas_api.h": "nvidia-cublas", "library_types.h": "nvidia-cublas",
    "nccl.h": "nvidia-nccl-cu13",
    "benchmark_throughput.py": "vLLM's benchmarks", "benchmark_serving.py": "vLLM's benchmarks",
}


def _expand(text: str) -> list[str]:
    """`a/{b,c}.log` -> [a/b.log, a/c.log]."""
    parts = re.split(r"\{([^{}]*)\}", text)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_paths(markdown: str, folders: set[str]) -> list[tuple[int, str]]:
    """(line, path) of every path-like citation in `markdown`; `folders`: the names of the
    repository's folders."""
    out, fenced = [], False
    for n, line in enumerate(markdown.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if "://" not in target and not target.startswith(("#", "mailto:")):
                out.append((n, target.split("#")[0]))
        for span in re.findall(r"`([^`]+)`", re.sub(r"\]\([^)]*\)", "", line)):
            span = span.strip().rstrip(",.:;")
            if (not span or re.search(r"\s", span) or "://" in span or span.startswith(("/", "~", "$", "-"))
                    or re.search(r"[<>=()\[\]'\"|@]", span)):
                continue
            if (any(Path(p).suffix in EXTENSIONS for p in _expand(span))
                    or ("/" in span and span.split("/")[0] in folders)):
                out.append((n, span))
    return out


def _repo_files() -> list[str]:
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if not SKIP_DIRS.intersection(rel.parts):
            out.append(rel.as_posix())
    return out


@pytest.fixture(scope="module")
def repo_files() -> list[str]:
    return _repo_files()


@pytest.fixture(scope="module")
def folders(repo_files) -> set[str]:
    return {Path(f).name for f in repo_files if (ROOT / f).is_dir()}


def exists(path: str, doc: Path, repo_files: list[str]) -> bool:
    if path.startswith(tuple(EXTERNAL)):
        return True
    for p in _expand(path.rstrip("/")):
        found = False
        for base in (ROOT, doc.parent):
            if not (base / p).resolve().is_relative_to(ROOT.resolve()):
                continue  # outside the repository: not a path of the repo, even where it exists here
            if list(base.glob(p)) if "*" in p else (base / p).exists():
                found = True
        if not found and not p.startswith("../"):
            pat = re.compile(r"(^|.*/)" + re.escape(p).replace(r"\*", "[^/]*") + r"$")
            found = any(pat.match(f) for f in repo_files)
        if not found:
            return False
    return True


def test_citations_are_found(folders):
    md = ("See `docs/POOL.md` and [the pool](POOL.md#arena), `runner/disco.py`, `a/{b,c}.log`.\n"
          "```\nmlc_lora compile x -o dist/none/at/all\n```\n"
          "Not paths: `alpha/r`, `heads/K`, `mlc_lora chat --prompt x`, `lib.<target>.so`, `https://x.org/a`.\n"
          "![chart](results/x/y.svg) and `src/no/such/folder`")
    assert cited_paths(md, folders) == [(1, "POOL.md"), (1, "docs/POOL.md"), (1, "runner/disco.py"),
                                        (1, "a/{b,c}.log"), (6, "results/x/y.svg"), (6, "src/no/such/folder")]


def test_a_missing_path_is_caught(repo_files):
    doc = ROOT / "docs" / "DESIGN.md"
    assert exists("docs/POOL.md", doc, repo_files) and exists("POOL.md", doc, repo_files)
    assert exists("runner/disco.py", doc, repo_files) and exists("ops/lora/sgmv.cu", doc, repo_files)
    assert exists("tests/python/{conftest,test_contract}.py", doc, repo_files)
    assert not exists("src/cuda_stub/cuda_stub.c", doc, repo_files)
    assert not exists("tests/python/{conftest,no_such_test}.py", doc, repo_files)
    assert not exists("../shared/research/gpu-facts.md", doc, repo_files)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_path_exists(doc, repo_files, folders):
    missing = [f"{doc.relative_to(ROOT)}:{n}: {p}" for n, p in cited_paths(doc.read_text(), folders)
               if not exists(p, doc, repo_files)]
    assert missing == [], "\n".join(missing)
