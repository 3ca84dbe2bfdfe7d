"""Build the small model's text corpus from Debian packages (the registry this project reaches).

    python -m training.corpus --out data/corpus     # downloads ~250 MB of .debs once

SOURCES below names each source's packages, its licence and how its text is read
(training/corpus_text.py converts the formats); docs/SMALL_MODEL.md lists them with versions
and sizes. Every package is unpacked into a folder of its source's own, so a source reads only
its packages.

Writes OUT/train.jsonl.gz and OUT/heldout.jsonl.gz, one {"source", "id", "text"} document per
line, OUT/facts.jsonl.gz (function signatures with their first docstring paragraph, section
titles with their first paragraph; training/chat_data.py turns them into chats), and
OUT/manifest.json (packages, versions, licences, document and character counts, what dedup and
the held-out guard dropped). Invariants:
- a document is held out when a hash of its id says so (about 2%, the same split on every
  build; ids of the first corpus's sources are unchanged, so the documents tests/data/
  small_heldout.txt was cut from stay held out);
- near-duplicate documents (MinHash over word 5-grams, training/corpus_dedup.py) are kept
  once, and a held-out document wins over its training duplicates, which are dropped;
- no training document shares a line of 60+ characters with tests/data/small_heldout.txt.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from training.corpus_dedup import near_duplicates
from training.corpus_text import (
    Fact,
    dict_entries,
    docstrings,
    html_to_text,
    info_nodes,
    man_to_text,
    pod_to_text,
    rst_facts,
    rst_to_text,
    tidy,
    vim_help_to_text,
)

HELDOUT_PER_MILLE = 20
MIN_CHARS = 200
FACTS_PER_SOURCE = 6000  # chats stay a minority of the training text
HELDOUT_PASSAGE = Path(__file__).resolve().parents[1] / "tests" / "data" / "small_heldout.txt"


@dataclass(frozen=True)
class Doc:
    source: str
    id: str
    text: str


Reader = Callable[[Path], Iterator[tuple[Doc, list[Fact]]]]


@dataclass(frozen=True)
class Source:
    name: str
    packages: tuple[str, ...]
    licence: str
    read: Reader


def is_heldout(doc_id: str) -> bool:
    digest = hashlib.sha256(doc_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELDOUT_PER_MILLE


def _read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", "replace")


def _rel(path: Path, root: Path, *suffixes: str) -> str:
    rel = str(path.relative_to(root))
    for suffix in suffixes:
        rel = rel.removesuffix(suffix)
    return rel


# ---- the readers, one per source ----


def read_python_docs(root: Path) -> Iterator[tuple[Doc, list[Fact]]]:
    rst_root = root / "usr/share/doc/python3.11/html/_sources"
    for path in sorted(rst_root.rglob("*.rst.txt")):
        page = _rel(path, rst_root, ".rst.txt")
        if page.startswith(("whatsnew/changelog", "license", "copyright")):
            continue
        text = rst_to_text(path.read_text(encoding="utf-8", errors="replace"))
        yield Doc("python-docs", page, text), list(rst_facts(text, page))


def _docstring_docs(lib: Path, source: str, id_prefix: str, skip_private: bool):
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if any(p in ("test", "tests", "testing", "idlelib", "lib2to3", "turtledemo", "benchmarks")
               for p in rel.parts):  # fmt: skip
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if skip_private and any(p.startswith("_") for p in module.split(".")):
            continue
        text, facts = docstrings(path.read_text(encoding="utf-8", errors="replace"), module)
        if text:
            yield Doc(source, id_prefix + module, text), facts


def read_stdlib_docstrings(root: Path) -> Iterator[tuple[Doc, list[Fact]]]:
    lib = root / "usr/lib/python3.11"
    for doc, facts in _docstring_docs(lib, "python-docstrings", "", True):
        if not doc.id.startswith("site-packages"):
            yield doc, facts


PYTHON_PACKAGES = ("python3-numpy", "python3-scipy", "python3-sympy", "python3-pandas",
                   "python3-matplotlib", "python3-sklearn", "python3-networkx",
                   "python3-statsmodels", "python3-twisted", "python3-sqlalchemy",
                   "python3-docutils")  # fmt: skip


def read_python_package_docstrings(root: Path) -> Iterator[tuple[Doc, list[Fact]]]:
    lib = root / "usr/lib/python3/dist-packages"
    for package in sorted(p.name for p in lib.iterdir() if (p / "__init__.py").is_file()):
        yield from _docstring_docs(lib / package, "python-package-docstrings", f"{package}:",
                                   True)  # fmt: skip


def read_git_doc(root: Path) -> Iterator[tuple[Doc, list[Fact]]]:
    for path in sorted((root / "usr/share/doc/git-doc").glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        text = re.sub(r"^(include|ifdef|endif|ifndef)::.*$", "", text, flags=re.M)
        text = re.sub(r"^([=\-~^+])\1{3,}\s*$", "", text, flags=re.M)
        yield Doc("git-doc", path.stem, tidy(text)), []


def read_perl_doc(root: Path) -> Iterator[tuple[Doc, list[Fact]]]:
    for path in sorted((root / "usr/share/perl").rglob("*.pod")):
        if re.match(r"perl\d+delta|perldelta|perlhist", path.stem):
            continue
        yield Doc("perl-doc", path.stem, pod_to_text(path.read_text("utf-8", "replace"))), []


def read_debian_reference(root: Path) -> Iterator[tuple[Doc, list[Fact]]]:
    for path in sorted((root / "usr/share/debian-reference").glob("*.en.html")):
        yield Doc("debian-reference", path.stem, html_to_text(path.read_text("utf-8"))), []


def read_fortunes(root: Path) -> Iterator[tuple[Doc, list[Fact]]]:
    for path in sorted((root / "usr/share/games/fortunes").glob("*")):
        if path.suffix or path.is_dir():
            continue
        cookies = [c.strip() for c in path.read_text("utf-8", "replace").split("\n%\n")]
        cookies = [c for c in cookies if c]
        for i in range(0, len(cookies), 20):  # a document of 20 cookies
            yield Doc("fortunes", f"{path.name}/{i // 20}", "\n\n".join(cookies[i : i + 20])), []


def _rst_tree(source: str, rst_root: Path, pattern: str, facts: bool, skip=()):
    for path in sorted(rst_root.rglob(pattern)):
        page = _rel(path, rst_root, ".gz", ".txt", ".rst")
        if any(part in skip for part in Path(page).parts):
            continue
        text = rst_to_text(_read(path))
        yield Doc(source, f"{source}:{page}", text), list(rst_facts(text, page)) if facts else []


def _html_tree(source: str, html_root: Path, pattern: str, facts: bool, skip=()):
    for path in sorted(html_root.rglob(pattern)):
        page = _rel(path, html_root, ".gz", ".en", ".html")
        if any(part in skip for part in Path(page).parts) or page.endswith(("genindex", "search")):
            continue
        text = html_to_text(_read(path))
        yield Doc(source, f"{source}:{page}", text), list(rst_facts(text, page)) if facts else []


def read_linux_doc(root: Path):
    docs = root / "usr/share/doc/linux-doc-6.1/Documentation"
    skip = ("translations", "devicetree", "ABI", "output", "sphinx", "sphinx-static")
    yield from _rst_tree("linux-doc", docs, "*.rst.gz", True, skip)
    yield from _rst_tree("linux-doc", docs, "*.txt.gz", False, skip)


def read_debian_handbook(root: Path):
    yield from _html_tree("debian-handbook", root / "usr/share/doc/debian-handbook/html/en-US",
                          "*.html", True, ("Common_Content",))  # fmt: skip


def read_debian_docs(root: Path):
    yield from _rst_tree("debian-policy", root / "usr/share/doc/debian-policy/policy.html/_sources",
                         "*.rst.txt", True)  # fmt: skip
    yield from _rst_tree("developers-reference", root / "usr/share/developers-reference/_sources",
                         "*.rst.txt", True)  # fmt: skip
    yield from _html_tree("maint-guide", root / "usr/share/doc/maint-guide/html", "*.en.html",
                          True)  # fmt: skip
    faq = root / "usr/share/doc/debian/FAQ/debian-faq.en.txt.gz"
    for i, part in enumerate(re.split(r"\n(?=\d+\. [A-Z])", _read(faq))):
        yield Doc("debian-faq", f"debian-faq:{i}", tidy(part)), []


def read_postgresql_doc(root: Path):
    yield from _html_tree("postgresql-doc", root / "usr/share/doc/postgresql-doc-15/html",
                          "*.html", True)  # fmt: skip


def read_django_doc(root: Path):
    yield from _html_tree("django-doc", root / "usr/share/doc/python-django-doc/html", "*.html",
                          True, ("_modules", "_static", "_images", "releases"))  # fmt: skip


def read_apache_doc(root: Path):
    manual = root / "usr/share/doc/apache2-doc/manual/en"
    yield from _html_tree("apache-doc", manual, "*.html", True)


def read_sqlite_doc(root: Path):
    yield from _html_tree("sqlite-doc", root / "usr/share/doc/sqlite3", "*.html", True,
                          ("releaselog", "c3ref", "session"))  # fmt: skip


def read_cmake_doc(root: Path):
    yield from _rst_tree("cmake-doc", root / "usr/share/doc/cmake-data/html/_sources",
                         "*.rst.txt", True, ("release",))  # fmt: skip


def read_erlang_doc(root: Path):
    yield from _html_tree("erlang-doc", root / "usr/share/doc/erlang-doc", "*.html", False)


def read_vim_help(root: Path):
    for path in sorted((root / "usr/share/vim").rglob("doc/*.txt")):
        if re.search(r"_(?!en)[a-z]{2}\.txt$", path.name):
            continue
        text = vim_help_to_text(path.read_text("utf-8", "replace"))
        yield Doc("vim-help", f"vim-help:{path.stem}", text), []


def read_man_pages(root: Path):
    pages = sorted((root / "usr/share/man").glob("man[1-8]/*.gz"))
    with ThreadPoolExecutor(2) as pool:  # groff runs as its own process
        texts = pool.map(lambda p: man_to_text(gzip.decompress(p.read_bytes())), pages)
        for path, text in zip(pages, texts):
            yield Doc("man-pages", f"man-pages:{path.parent.name}/{path.stem}", text), []


def read_gnu_manuals(root: Path):
    """Info manuals, a document per 40 nodes."""
    for path in sorted((root / "usr/share/info").glob("*.info*.gz")):
        nodes = list(info_nodes(_read(path)))
        name = path.name.split(".info")[0]
        for i in range(0, len(nodes), 40):
            text = "\n\n".join(nodes[i : i + 40])
            yield Doc("gnu-manuals", f"gnu-manuals:{name}/{i // 40}", text), []


def read_dictionaries(root: Path):
    """dictd dictionaries, a document per 50 entries in the index's (alphabetical) order."""
    for index in sorted((root / "usr/share/dictd").glob("*.index")):
        data = gzip.decompress(index.with_suffix(".dict.dz").read_bytes())
        entries = list(dict_entries(index.read_text("utf-8", "replace"), data))
        for i in range(0, len(entries), 50):
            text = "\n\n".join(entries[i : i + 50])
            yield Doc("dictionaries", f"dictionaries:{index.stem}/{i // 50}", text), []


def read_gimp_help(root: Path):
    yield from _html_tree("gimp-help", root / "usr/share/gimp/2.0/help/en", "*.html", True)


SOURCES: tuple[Source, ...] = (
    Source("python-docs", ("python3.11-doc",), "PSF-2.0", read_python_docs),
    Source(
        "python-docstrings",
        ("libpython3.11-minimal", "libpython3.11-stdlib"),
        "PSF-2.0",
        read_stdlib_docstrings,
    ),  # fmt: skip
    Source("git-doc", ("git-doc",), "GPL-2", read_git_doc),
    Source("perl-doc", ("perl-doc",), "GPL-1+ or Artistic", read_perl_doc),
    Source("debian-reference", ("debian-reference-en",), "GPL-2+", read_debian_reference),
    Source("fortunes", ("fortunes", "fortunes-min"), "BSD-3-Clause", read_fortunes),
    Source(
        "linux-doc",
        ("linux-doc-6.1",),
        "GPL-2 (files may say GPL-2+ or CC-BY-4.0 too)",
        read_linux_doc,
    ),  # fmt: skip
    Source(
        "debian-handbook", ("debian-handbook",), "GPL-2+ or CC-BY-SA-3.0", read_debian_handbook
    ),  # fmt: skip
    Source(
        "debian-docs",
        ("debian-policy", "developers-reference", "maint-guide", "debian-faq"),
        "GPL-2+ (policy: GPL-2+; developers-reference: GPL-2; maint-guide: GPL-2+ or MIT; "
        "FAQ: verbatim-copying notice of SPI)",
        read_debian_docs,
    ),  # fmt: skip
    Source("postgresql-doc", ("postgresql-doc-15",), "PostgreSQL", read_postgresql_doc),
    Source("django-doc", ("python-django-doc",), "BSD-3-Clause", read_django_doc),
    Source("apache-doc", ("apache2-doc",), "Apache-2.0", read_apache_doc),
    Source("sqlite-doc", ("sqlite3-doc",), "public domain", read_sqlite_doc),
    Source("cmake-doc", ("cmake-doc",), "BSD-3-Clause", read_cmake_doc),
    Source("erlang-doc", ("erlang-doc",), "Apache-2.0", read_erlang_doc),
    Source("vim-help", ("vim-runtime",), "Vim (GPL-compatible charityware)", read_vim_help),
    Source(
        "man-pages",
        ("manpages", "manpages-dev"),
        "the Linux man-pages project's per-page free licences (verbatim, BSD, GPL-2+)",
        read_man_pages,
    ),  # fmt: skip
    Source(
        "gnu-manuals",
        ("bash-doc", "coreutils", "grep", "sed", "gnu-standards"),
        "GFDL-1.3, no invariant sections (bash, coreutils, grep, sed); GNU standards: "
        "verbatim-and-modified-copying notice",
        read_gnu_manuals,
    ),  # fmt: skip
    Source(
        "python-package-docstrings",
        PYTHON_PACKAGES,
        "BSD-3-Clause (numpy, scipy, sympy, pandas, scikit-learn, networkx, statsmodels), "
        "MIT (twisted, sqlalchemy), public domain and BSD-2-Clause (docutils), Matplotlib "
        "licence (PSF-based)",
        read_python_package_docstrings,
    ),  # fmt: skip
    Source(
        "dictionaries",
        ("dict-foldoc", "dict-jargon", "dict-devil", "dict-gcide"),
        "FOLDOC: GFDL-1.1+; Jargon File: public domain; The Devil's Dictionary: public "
        "domain; GCIDE: GPL-3+",
        read_dictionaries,
    ),  # fmt: skip
    Source(
        "gimp-help",
        ("gimp-help-en", "gimp-help-common"),
        "GFDL-1.2+, no invariant sections",
        read_gimp_help,
    ),  # fmt: skip
)


# ---- building ----


def download(packages: list[str], cache: Path) -> dict[str, Path]:
    """apt-get download each package into `cache` (once); name -> .deb path."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if not list(cache.glob(f"{p}_*.deb"))]
    if missing:
        subprocess.run(["apt-get", "download", "-q", *missing], cwd=cache, check=True)
    return {p: sorted(cache.glob(f"{p}_*.deb"))[-1] for p in packages}


def package_versions(debs: dict[str, Path]) -> dict[str, str]:
    return {
        name: subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
        ).stdout.strip()
        for name, deb in debs.items()
    }


def _guard_lines() -> set[str]:
    """The held-out test passage's long lines: no training document may contain one."""
    if not HELDOUT_PASSAGE.is_file():
        return set()
    lines = HELDOUT_PASSAGE.read_text(encoding="utf-8").splitlines()
    return {" ".join(x.split()) for x in lines if len(x.strip()) >= 60}


def _collect(sources: tuple[Source, ...], debs: dict[str, Path], tmp: Path):
    """(docs, facts per doc index, seconds per source), every source's packages unpacked."""
    docs: list[Doc] = []
    facts: dict[int, list[Fact]] = {}
    seconds: dict[str, float] = {}
    for source in sources:
        began = time.monotonic()
        root = tmp / source.name
        for package in source.packages:
            subprocess.run(["dpkg-deb", "-x", str(debs[package]), str(root)], check=True)
        before = len(docs)
        for doc, doc_facts in source.read(root):
            if len(doc.text) >= MIN_CHARS:
                facts[len(docs)] = doc_facts
                docs.append(doc)
        subprocess.run(["rm", "-rf", str(root)], check=True)
        seconds[source.name] = round(time.monotonic() - began, 1)
        print(f"corpus: {source.name}: {len(docs) - before} documents in {seconds[source.name]} s",
              flush=True)  # fmt: skip
    return docs, facts, seconds


def build(out: Path, cache: Path, sources: tuple[Source, ...] = SOURCES) -> dict:
    began = time.monotonic()
    debs = download([p for s in sources for p in s.packages], cache)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        docs, doc_facts, seconds = _collect(sources, debs, Path(tmp))
    heldout = [is_heldout(d.id) for d in docs]
    dropped = near_duplicates([d.text for d in docs], prefer=heldout)
    guard = _guard_lines()
    counts: dict[str, dict[str, int]] = {}
    removed = {"near_duplicates": len(dropped), "held_out_passage_guard": 0}
    facts: dict[str, list[Fact]] = {}
    with (
        gzip.open(out / "train.jsonl.gz", "wt", encoding="utf-8") as train,
        gzip.open(out / "heldout.jsonl.gz", "wt", encoding="utf-8") as held,
    ):
        for i, doc in enumerate(docs):
            if i in dropped:
                continue
            if (
                not heldout[i]
                and guard
                and any(" ".join(x.split()) in guard for x in doc.text.splitlines() if len(x) >= 60)
            ):
                removed["held_out_passage_guard"] += 1
                continue
            split = "heldout" if heldout[i] else "train"
            line = json.dumps({"source": doc.source, "id": doc.id, "text": doc.text})
            (held if heldout[i] else train).write(line + "\n")
            c = counts.setdefault(f"{doc.source}/{split}", {"docs": 0, "chars": 0})
            c["docs"] += 1
            c["chars"] += len(doc.text)
            if not heldout[i]:  # chats are made from training documents only
                facts.setdefault(doc.source, []).extend(doc_facts[i])
    kept: list[Fact] = []
    for source in sorted(facts):  # a deterministic sample per source
        rng = random.Random(source)
        pool = facts[source]
        kept += rng.sample(pool, FACTS_PER_SOURCE) if len(pool) > FACTS_PER_SOURCE else pool
    with gzip.open(out / "facts.jsonl.gz", "wt", encoding="utf-8") as f:
        for fact in kept:
            f.write(json.dumps(fact.__dict__) + "\n")
    versions = package_versions(debs)
    manifest = {
        "sources": {
            s.name: {
                "licence": s.licence,
                "packages": {p: versions[p] for p in s.packages},
                "read_s": seconds[s.name],
            }
            for s in sources
        },  # fmt: skip
        "documents": counts,
        "removed": removed,
        "facts": len(kept),
        "build_s": round(time.monotonic() - began, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_docs(path: Path) -> Iterator[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="data/corpus", help="output folder (default data/corpus)")
    ap.add_argument("--cache", default="data/debs", help="where the .debs are kept")
    ap.add_argument("--sources", default=None, help="comma-separated subset of the sources")
    args = ap.parse_args()
    sources = SOURCES
    if args.sources:
        names = set(args.sources.split(","))
        unknown = names - {s.name for s in SOURCES}
        if unknown:
            ap.error(f"unknown sources: {', '.join(sorted(unknown))}")
        sources = tuple(s for s in SOURCES if s.name in names)
    manifest = build(Path(args.out), Path(args.cache), sources)
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
