"""Build the small model's text corpus from Debian packages (the registry this project reaches).

    python -m serving.tools.corpus --out data/corpus        # downloads ~17 MB of .debs once

Sources (docs/SMALL_MODEL.md lists versions and licences):
  python3.11-doc               the Python documentation's reStructuredText sources, as text
  libpython3.11-{minimal,stdlib}  docstrings of the standard library, pydoc-style
  git-doc                      Git's manual pages and guides (AsciiDoc text)
  perl-doc                     Perl's manual (POD, as text; the per-release change logs left out)
  debian-reference-en          the Debian Reference (HTML, as text)
  fortunes, fortunes-min       fortune cookies

Writes OUT/train.jsonl.gz and OUT/heldout.jsonl.gz, one {"source", "id", "text"} document per
line (a document is held out when a hash of its id says so: about 2%, the same split on every
build), OUT/facts.jsonl.gz (function signatures with their first docstring paragraph, section
titles with their first paragraph; serving/tools/chat_data.py turns them into chats), and
OUT/manifest.json (packages, versions, document and character counts).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import html.parser
import json
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = (
    "python3.11-doc",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "git-doc",
    "perl-doc",
    "debian-reference-en",
    "fortunes",
    "fortunes-min",
)
HELDOUT_PER_MILLE = 20


@dataclass(frozen=True)
class Doc:
    source: str
    id: str
    text: str


@dataclass(frozen=True)
class Fact:
    """A subject (a callable's name or a section title) and the paragraph that explains it."""

    kind: str  # "function" | "section"
    subject: str
    signature: str
    text: str


def is_heldout(doc_id: str) -> bool:
    digest = hashlib.sha256(doc_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELDOUT_PER_MILLE


def download(packages: tuple[str, ...], cache: Path) -> dict[str, Path]:
    """apt-get download each package into `cache` (once); name -> .deb path."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if not list(cache.glob(f"{p}_*.deb"))]
    if missing:
        subprocess.run(["apt-get", "download", "-q", *missing], cwd=cache, check=True)
    return {p: sorted(cache.glob(f"{p}_*.deb"))[-1] for p in packages}


def unpack(debs: dict[str, Path], root: Path) -> None:
    for deb in debs.values():
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)


def tidy(text: str) -> str:
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# ---- reStructuredText (the Python docs) ----

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_UNDERLINE = re.compile(r"^([=\-~^\"'*+#`.])\1{2,}\s*$")
_API = ("function", "method", "class", "attribute", "data", "exception", "decorator",
        "classmethod", "staticmethod", "coroutinefunction", "coroutinemethod")  # fmt: skip
_VERSION = {"versionadded": "New in version", "versionchanged": "Changed in version",
            "deprecated": "Deprecated since version"}  # fmt: skip


def rst_to_text(rst: str) -> str:
    out: list[str] = []
    skipping = False
    for line in rst.splitlines():
        if skipping:  # options and bodies of dropped directives are indented
            if not line.strip() or line.startswith((" ", "\t")):
                continue
            skipping = False
        if _UNDERLINE.match(line):
            continue
        m = re.match(r"\s*\.\.\s+([a-z:\-]+)::\s*(.*)$", line)
        if m:
            name, arg = m.group(1).split(":")[-1], m.group(2)
            if name in _API:
                out.append(arg)
            elif name in _VERSION:
                out.append(f"{_VERSION[name]} {arg}".rstrip() + ".")
            elif name in ("note", "warning", "tip", "important", "seealso"):
                out.append(f"{name.capitalize()}: {arg}".rstrip())
            elif name in ("code-block", "sourcecode", "doctest", "testcode"):
                out.append("")
            else:
                skipping = True
            continue
        if re.match(r"\s*\.\.\s", line) or line.strip() == "..":  # comments, labels, targets
            skipping = True
            continue
        line = _ROLE.sub(r"\1", line).replace("``", "`")
        line = re.sub(r"(\S)::$", r"\1:", line)
        out.append("" if line.strip() == "::" else line)
    return tidy("\n".join(out))


def rst_facts(text: str, page: str) -> Iterator[Fact]:
    """(signature, first paragraph) of each API entry, (title, first paragraph) of each section."""
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    for head, body in zip(blocks, blocks[1:]):
        head, para = head.strip(), " ".join(body.split())
        if "\n" in head or len(para) < 80 or para.startswith((">>>", "$")):
            continue
        call = re.match(r"^([A-Za-z_][\w.]*)\((.*)\)$", head)
        if call:
            yield Fact("function", call.group(1), head, para)
        elif 3 <= len(head) <= 60 and head[0].isupper() and not head.endswith((".", ":", ",")):
            yield Fact("section", f"{head} ({page})", head, para)


# ---- docstrings (the standard library) ----


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    return re.sub(r"^self,?\s*|^cls,?\s*", "", args)


def docstrings(source: str, module: str) -> tuple[str, list[Fact]]:
    """The module's public docstrings as pydoc-like text, and one fact per documented callable."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return "", []
    parts, facts = [], []
    if doc := ast.get_docstring(tree):
        parts.append(f"Help on module {module}:\n\n{doc}")

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            if node.name.startswith("_") or not (doc := ast.get_docstring(node)):
                continue
            name = f"{prefix}.{node.name}"
            if isinstance(node, ast.ClassDef):
                sig = f"class {name}"
                visit(node.body, name)
            else:
                sig = f"{name}({_signature(node)})"
            indented = "\n".join("    " + x if x else "" for x in doc.splitlines())
            parts.append(f"{sig}\n{indented}")
            first = " ".join(doc.split("\n\n")[0].split())
            if len(first) >= 40:
                facts.append(Fact("function", name, sig, first))

    visit(tree.body, module)
    return tidy("\n\n".join(parts)), facts


# ---- POD (the Perl manual) ----

_POD_CODE = re.compile(r"[BICFSLEXZ]<{1,3}\s*(.*?)\s*>{1,3}", re.S)


def pod_to_text(pod: str) -> str:
    out: list[str] = []
    keep = True
    for line in pod.splitlines():
        if line.startswith("="):
            word, _, rest = line.partition(" ")
            if word in ("=head1", "=head2", "=head3", "=head4", "=item"):
                out.append(("* " if word == "=item" else "") + rest.strip())
            elif word in ("=begin", "=for"):
                keep = False
            elif word == "=end":
                keep = True
            continue
        if keep:
            out.append(line)
    text = "\n".join(out)
    for _ in range(3):  # nested formatting codes
        text = _POD_CODE.sub(lambda m: m.group(1).split("|")[0], text)
    return tidy(text)


# ---- HTML (the Debian Reference) ----


class _HTMLText(html.parser.HTMLParser):
    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "pre", "dt", "dd", "title"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self.skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n\n" if tag != "br" else "\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self.skip -= 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_to_text(page: str) -> str:
    parser = _HTMLText()
    parser.feed(page)
    text = "".join(parser.parts)
    lines = [" ".join(x.split()) if not x.startswith(" ") else x.rstrip() for x in text.split("\n")]
    return tidy("\n".join(lines))


# ---- the packages ----


def read_sources(root: Path) -> Iterator[tuple[Doc, list[Fact]]]:
    rst_root = root / "usr/share/doc/python3.11/html/_sources"
    for path in sorted(rst_root.rglob("*.rst.txt")):
        page = str(path.relative_to(rst_root))[: -len(".rst.txt")]
        if page.startswith(("whatsnew/changelog", "license", "copyright")):
            continue
        text = rst_to_text(path.read_text(encoding="utf-8", errors="replace"))
        yield Doc("python-docs", page, text), list(rst_facts(text, page))
    lib = root / "usr/lib/python3.11"
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if any(p in ("test", "tests", "idlelib", "lib2to3", "turtledemo") for p in rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if any(p.startswith("_") for p in module.split(".")) or module.startswith("site-packages"):
            continue
        text, facts = docstrings(path.read_text(encoding="utf-8", errors="replace"), module)
        if text:
            yield Doc("python-docstrings", module, text), facts
    for path in sorted((root / "usr/share/doc/git-doc").glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        text = re.sub(r"^(include|ifdef|endif|ifndef)::.*$", "", text, flags=re.M)
        text = re.sub(r"^([=\-~^+])\1{3,}\s*$", "", text, flags=re.M)
        yield Doc("git-doc", path.stem, tidy(text)), []
    for path in sorted((root / "usr/share/perl").rglob("*.pod")):
        if re.match(r"perl\d+delta|perldelta|perlhist", path.stem):
            continue
        yield Doc("perl-doc", path.stem, pod_to_text(path.read_text("utf-8", "replace"))), []
    for path in sorted((root / "usr/share/debian-reference").glob("*.en.html")):
        yield Doc("debian-reference", path.stem, html_to_text(path.read_text("utf-8"))), []
    fortunes_dir = root / "usr/share/games/fortunes"
    for path in sorted(fortunes_dir.glob("*")):
        if path.suffix or path.is_dir():
            continue
        cookies = [c.strip() for c in path.read_text("utf-8", "replace").split("\n%\n")]
        cookies = [c for c in cookies if c]
        for i in range(0, len(cookies), 20):  # a document of 20 cookies
            yield Doc("fortunes", f"{path.name}/{i // 20}", "\n\n".join(cookies[i : i + 20])), []


def package_versions(debs: dict[str, Path]) -> dict[str, str]:
    return {
        name: subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
        ).stdout.strip()
        for name, deb in debs.items()
    }


def build(out: Path, cache: Path) -> dict:
    debs = download(PACKAGES, cache)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    facts: list[Fact] = []
    with tempfile.TemporaryDirectory() as tmp:
        unpack(debs, Path(tmp))
        with (
            gzip.open(out / "train.jsonl.gz", "wt", encoding="utf-8") as train,
            gzip.open(out / "heldout.jsonl.gz", "wt", encoding="utf-8") as heldout,
        ):
            for doc, doc_facts in read_sources(Path(tmp)):
                if len(doc.text) < 200:
                    continue
                split = "heldout" if is_heldout(doc.id) else "train"
                line = json.dumps({"source": doc.source, "id": doc.id, "text": doc.text})
                (heldout if split == "heldout" else train).write(line + "\n")
                c = counts.setdefault(f"{doc.source}/{split}", {"docs": 0, "chars": 0})
                c["docs"] += 1
                c["chars"] += len(doc.text)
                if split == "train":  # chats are made from training documents only
                    facts += doc_facts
    with gzip.open(out / "facts.jsonl.gz", "wt", encoding="utf-8") as f:
        for fact in facts:
            f.write(json.dumps(fact.__dict__) + "\n")
    manifest = {"packages": package_versions(debs), "documents": counts, "facts": len(facts)}
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
    args = ap.parse_args()
    manifest = build(Path(args.out), Path(args.cache))
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
