"""Documentation formats as plain text, for training/corpus.py: reStructuredText, Python
docstrings (read with ast, never imported), POD, HTML (navigation left out), roff manual pages
(rendered by groff), Info manuals and Vim help files. Each converter takes one document's source
and returns its text; rst_facts and docstrings also return the facts chat_data turns into chats.
"""

from __future__ import annotations

import ast
import html.parser
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Fact:
    """A subject (a callable's name or a section title) and the paragraph that explains it."""

    kind: str  # "function" | "section"
    subject: str
    signature: str
    text: str


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


# ---- HTML (the Debian Reference, the handbooks, the manuals' HTML builds) ----

# class or id words of elements that hold navigation, not text (Sphinx, DocBook, Publican,
# Apache's and SQLite's own themes)
NAV_MARKERS = frozenset({
    "navheader", "navfooter", "sphinxsidebar", "sphinxsidebarwrapper", "related", "footer",
    "header", "breadcrumbs", "breadcrumb", "nav", "navigation", "menu", "docnav", "quickview",
    "page-header", "searchbox", "headerlink", "toplang", "bottomlang", "toc", "docs-toc",
    "search", "skip", "copyright", "footnav", "topnav", "sitemap", "rellinks", "doc-sidebar",
})  # fmt: skip
_VOID = frozenset({"br", "img", "meta", "link", "input", "hr", "col", "area", "base", "wbr"})


class _HTMLText(html.parser.HTMLParser):
    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "pre", "dt", "dd",
              "title", "table", "blockquote", "section"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_tag: str | None = None  # the element being left out, and its nesting depth
        self.skip_depth = 0

    def handle_starttag(self, tag, attrs):
        if self.skip_tag is not None:
            self.skip_depth += tag == self.skip_tag
            return
        words = set()
        for name, value in attrs:
            if name in ("class", "id", "role") and value:
                words.update(value.lower().split())
        left_out = tag in ("script", "style", "nav", "head", "footer") or words & NAV_MARKERS
        if tag not in _VOID and left_out:
            self.skip_tag, self.skip_depth = tag, 1
        elif tag in self.BLOCKS:
            self.parts.append("\n\n" if tag != "br" else "\n")

    def handle_endtag(self, tag):
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if self.skip_tag is None:
            self.parts.append(data)


def html_to_text(page: str) -> str:
    parser = _HTMLText()
    parser.feed(page)
    text = "".join(parser.parts).replace("\u00b6", "")
    lines = [" ".join(x.split()) if not x.startswith(" ") else x.rstrip() for x in text.split("\n")]
    return tidy("\n".join(lines))


# ---- roff manual pages ----


def man_to_text(roff: bytes) -> str:
    """A manual page rendered by groff (tbl for its tables), without its running header and
    footer lines; "" for a page that only sources another (`.so`)."""
    head = roff.lstrip()[:200]
    if head.startswith(b".so ") and roff.count(b"\n") <= 3:
        return ""
    out = subprocess.run(
        ["groff", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=78n"],
        input=roff,
        capture_output=True,
        check=False,
    ).stdout.decode("utf-8", "replace")
    lines = [x for x in out.splitlines()]
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return tidy("\n".join(lines[1:-1]))


# ---- Info manuals ----

_INFO_NODE = re.compile(r"\x1f\n(?:File: [^\n]*\n)?")


def info_nodes(info: str) -> Iterator[str]:
    """An Info manual's nodes as text: no node headers, menus, tag table or indirect table."""
    for node in _INFO_NODE.split(info):
        if node.startswith(("Tag Table:", "Indirect:", "Local Variables")) or "\x00" in node:
            continue
        out, in_menu = [], False
        for line in node.splitlines():
            if line.startswith("* Menu:"):
                in_menu = True
                continue
            if in_menu and (line.startswith("* ") or line.startswith(" ") or not line.strip()):
                continue
            in_menu = False
            out.append(line)
        text = tidy("\n".join(out))
        if text:
            yield text


# ---- Vim help ----


def vim_help_to_text(help_text: str) -> str:
    """A Vim help file without its tag markup: *tag* targets go, |link| and `cmd` keep their
    words, the modeline and the ~ heading markers go."""
    out = []
    for line in help_text.splitlines():
        if line.startswith(" vim:") or re.match(r"^\s*vim:", line):
            continue
        line = re.sub(r"\s*\*[^*\s|]+\*", "", line)
        line = re.sub(r"\|([^|\s]+)\|", r"\1", line)
        line = re.sub(r"~$", "", line)
        out.append(line.rstrip())
    return tidy("\n".join(out))


# ---- dictd dictionaries ----

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64(text: str) -> int:
    value = 0
    for ch in text:
        value = value * 64 + _B64.index(ch)
    return value


def dict_entries(index: str, data: bytes) -> Iterator[str]:
    """A dictd dictionary's entries in the index's order (each once; the 00-database-* entries,
    the dictionary's own header, left out)."""
    seen: set[tuple[int, int]] = set()
    for line in index.splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith(("00-database", "00database")):
            continue
        span = (_b64(parts[1]), _b64(parts[2]))
        if span in seen:
            continue
        seen.add(span)
        text = data[span[0] : span[0] + span[1]].decode("utf-8", "replace")
        yield tidy(text)
