"""Build small corpora of other kinds than the embedded one (the stdlib's sources), from what
every Python install has, so that the balancer can be checked on data it was never tuned on:

    prose/prose.jsonl      English prose: the Python documentation's topic texts
                           (`pydoc_data.topics`), one document per section, and the long
                           docstrings of the standard library (one document per module)
    mixture/mixture.jsonl  the prose documents interleaved with stdlib source files picked by
                           the hash of their paths, about half code and half prose by size

JSON Lines, one `{"text": ...}` record per document, written deterministically (same Python
version, same files). Nothing is downloaded.

    python tools/make_corpora.py /tmp/corpora
    moebalance ab deepseek4-tiny dataset_path=/tmp/corpora/prose dataset_glob=*.jsonl --out DIR
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import re
import sysconfig
from pathlib import Path

import pydoc_data.topics

MIN_CHARS = 400  # shorter sections and docstrings are headings, stubs or one-liners
SECTION_TARGET = 3000  # topic sections shorter than this are merged with the next one
MAX_CODE_CHARS = 30000  # so that no single source file weighs much in the mixture
UNDERLINE = re.compile(r"^\s*[=\-*^~]{3,}\s*$")  # a reST heading's underline


def topic_documents() -> list[str]:
    """The documentation topics split at their headings, short sections merged forward."""
    docs = []
    for name in sorted(pydoc_data.topics.topics):
        lines = pydoc_data.topics.topics[name].splitlines()
        section: list[str] = []
        for i, line in enumerate(lines):
            heading = i + 1 < len(lines) and UNDERLINE.match(lines[i + 1]) and line.strip()
            if heading and sum(map(len, section)) >= SECTION_TARGET:
                docs.append("\n".join(section).strip())
                section = []
            section.append(line)
        docs.append("\n".join(section).strip())
    return [doc for doc in docs if len(doc) >= MIN_CHARS]


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted, without tests and third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages")
                            and not d.startswith(("test", "idle_test")))
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def module_docstrings(path: Path) -> str | None:
    """The module's, its classes' and its functions' docstrings of at least MIN_CHARS (cleaned
    of indentation), in source order and joined by blank lines; None when there are none or the
    file cannot be parsed."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return None
    nodes = [tree] + [node for node in ast.walk(tree) if isinstance(
        node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docs = [ast.get_docstring(node, clean=False) for node in nodes]
    docs = [inspect.cleandoc(doc) for doc in docs if doc and len(doc) >= MIN_CHARS]
    return "\n\n".join(docs) or None


def docstring_documents(sources: list[Path]) -> list[str]:
    return [doc for doc in map(module_docstrings, sources) if doc]


def code_documents(sources: list[Path], chars: int) -> list[str]:
    """Stdlib source files of at most MAX_CODE_CHARS, taken in the order of their names' hashes
    (a stable pick from all over the library) until they hold about `chars` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    ranked = sorted(sources, key=lambda p: hashlib.sha256(
        p.relative_to(root).as_posix().encode()).hexdigest())
    docs, total = [], 0
    for path in ranked:
        if total >= chars:
            break
        text = path.read_text("utf-8", errors="replace")
        if text.strip() and len(text) <= MAX_CODE_CHARS:
            docs.append(text)
            total += len(text)
    return docs


def interleave(a: list[str], b: list[str]) -> list[str]:
    """a[0], b[0], a[1], b[1], ...; the longer list's tail at the end."""
    out = [x for pair in zip(a, b) for x in pair]
    return out + a[len(b):] + b[len(a):]


def write_jsonl(path: Path, docs: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    size = path.stat().st_size
    print(f"{path}: {len(docs)} documents, {sum(map(len, docs))} characters, {size} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write prose/ and mixture/ into")
    out = parser.parse_args().out
    sources = stdlib_sources()
    prose = topic_documents() + docstring_documents(sources)
    write_jsonl(out / "prose" / "prose.jsonl", prose)
    code = code_documents(sources, sum(map(len, prose)))
    write_jsonl(out / "mixture" / "mixture.jsonl", interleave(prose, code))


if __name__ == "__main__":
    main()
