"""Build small corpora of other kinds than the embedded one (the stdlib's sources), from what
every Python install has and from what a Linux machine keeps under /usr, so that the balancer can
be checked on data it was never tuned on:

    prose/prose.jsonl      English prose: the Python documentation's topic texts
                           (`pydoc_data.topics`), one document per section, and the long
                           docstrings of the standard library (one document per module)
    mixture/mixture.jsonl  the prose documents interleaved with stdlib source files picked by
                           the hash of their paths, about half code and half prose by size
    c/c.jsonl              C headers from /usr/include, whole files (one per file name, none with
                           C++ constructs), about 3 MB
    man/man.jsonl          English manual pages (/usr/share/man/man1..man8) as plain text, one
                           document per page, one page per name up to its first underscore (so
                           that families of generated pages, gcloud_*, count once), about 3 MB
    intl/intl.jsonl        the translated manual pages (/usr/share/man/<language>/), the same way,
                           interleaved across the languages, about 3 MB
    plain/NNNN.txt         plain-text files, one per document: READMEs, NEWS, changelogs and
                           copyright files from /usr/share/doc (.gz ones decompressed), about 3 MB

The files under /usr are taken whole (MIN_CHARS to MAX_DOC_CHARS characters, no text twice) in
the order of the hashes of their paths, until the corpus holds TARGET_BYTES of text; a source this
machine lacks is skipped with a message. JSON Lines, one `{"text": ...}` record per document,
written deterministically (same Python version, same files). Nothing is downloaded.

    python tools/make_corpora.py /tmp/corpora
    python tools/make_corpora.py /tmp/corpora --only c,man
    moebalance ab deepseek4-tiny dataset_path=/tmp/corpora/prose dataset_glob=*.jsonl --out DIR
    moebalance ab deepseek4-tiny dataset_path=/tmp/corpora/plain dataset_glob=*.txt --out DIR
"""

from __future__ import annotations

import argparse
import ast
import collections
import gzip
import hashlib
import inspect
import json
import os
import re
import sysconfig
import unicodedata
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pydoc_data.topics

MIN_CHARS = 400  # shorter sections and docstrings are headings, stubs or one-liners
SECTION_TARGET = 3000  # topic sections shorter than this are merged with the next one
MAX_DOC_CHARS = 30000  # so that no single file weighs much in a corpus
TARGET_BYTES = 3_000_000  # the UTF-8 text each corpus built from /usr holds, about
UNDERLINE = re.compile(r"^\s*[=\-*^~]{3,}\s*$")  # a reST heading's underline
INCLUDE = Path("/usr/include")
MAN = Path("/usr/share/man")
DOC = Path("/usr/share/doc")
CPLUSPLUS = re.compile(r"^\s*(?:namespace\b|template\s*<|class\s+\w)", re.M)
DOC_NAME = re.compile(r"^(README|NEWS|CHANGELOG|CHANGES|HISTORY|AUTHORS|THANKS|TODO|FAQ|copyright)"
                      r"(?:[._-].*)?$|\.txt(?:\.gz)?$", re.I)


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
    """Stdlib source files of at most MAX_DOC_CHARS, taken in the order of their names' hashes
    (a stable pick from all over the library) until they hold about `chars` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    ranked = sorted(sources, key=lambda p: hashlib.sha256(
        p.relative_to(root).as_posix().encode()).hexdigest())
    docs, total = [], 0
    for path in ranked:
        if total >= chars:
            break
        text = path.read_text("utf-8", errors="replace")
        if text.strip() and len(text) <= MAX_DOC_CHARS:
            docs.append(text)
            total += len(text)
    return docs


def interleave(a: list[str], b: list[str]) -> list[str]:
    """a[0], b[0], a[1], b[1], ...; the longer list's tail at the end."""
    out = [x for pair in zip(a, b) for x in pair]
    return out + a[len(b):] + b[len(a):]


ROFF_GLYPHS = {
    "em": "\u2014", "en": "\u2013", "hy": "-", "mi": "-", "pl": "+", "eq": "=", "bu": "\u2022",
    "aq": "'", "dq": '"', "lq": "\u201c", "rq": "\u201d", "oq": "\u2018", "cq": "\u2019",
    "Bq": "\u201e", "bq": "\u201a", "Fo": "\u00ab", "Fc": "\u00bb", "co": "\u00a9",
    "rg": "\u00ae", "tm": "\u2122", "de": "\u00b0", "mu": "\u00d7", "+-": "\u00b1",
    "<=": "\u2264", ">=": "\u2265", "->": "\u2192", "<-": "\u2190", "ss": "\u00df",
    "rs": "\\", "sl": "/", "ga": "`", "ha": "^", "ti": "~", "ci": "\u25cb", "*p": "\u03c0",
}
ROFF_ACCENTS = {"'": "\u0301", "`": "\u0300", ":": "\u0308", "^": "\u0302", "~": "\u0303",
                ",": "\u0327", "o": "\u030a"}  # \('e, \(`a, \(:u, \(^o, \(~n, \(,c, \(oa
ROFF_STRINGS = {"C`": '"', "C'": '"', 'L"': '"', 'R"': '"', "Aq": "'", "--": "\u2014",
                "lq": "\u201c", "rq": "\u201d", "Tm": "\u2122", "R": "\u00ae", "PI": "\u03c0"}
ROFF_CHARS = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "t": "\t", "'": "'",
              "`": "`", ".": ".", "E": "\\"}  # any other one-character escape is dropped
ROFF_ESCAPE = re.compile(r"""\\(?:
      \((?P<glyph>..) | \[(?P<long>[^\]]*)\]                    # \(em  \[em]  \[u00E9]
    | \*(?:\((?P<s2>..)|\[(?P<sl>[^\]]*)\]|(?P<s1>.))          # strings: \*(L"  \*R
    | [fFgkmMnVY][-+]?(?:\(..|\[[^\]]*\]|.)                    # fonts, registers, colours
    | s[-+]?(?:\d\d?|\(\d\d|\[[^\]]*\])                        # type size: \s-1  \s0
    | (?P<delim>[hvwoDlLXZbNRSxAB])(?P<q>.)(?P<arg>.*?)(?P=q)  # \h'2m'  \N'233'
    | (?P<char>.)
)""", re.X)
ROFF_COMMENT = re.compile(r'^((?:[^\\]|\\[^"#])*)\\["#]')
ROFF_CONTINUED = re.compile(r"(?:[^\\]|\\.)*\\")
ROFF_REQUEST = re.compile(r"^[.'][ \t]*(\S*)[ \t]*(.*)$")
ROFF_ARG = re.compile(r'"((?:[^"]|"")*)"?|((?:\\.|[^\s\\])+)')
ROFF_BLOCKS = {"de", "de1", "dei", "am", "am1", "ami", "ig"}  # skipped up to their ".." line
ROFF_BREAKS = {"SH", "SS", "Sh", "Ss", "PP", "LP", "P", "Pp", "TP", "TQ", "IP", "HP", "Sp", "sp",
               "bP"}  # a blank line before
ROFF_TEXTLESS = {"TH", "TP", "TQ", "HP", "RS", "RE", "PD", "IX", "TE", "Dd", "Dt", "Os", "Vb", "Ve",
                 "Bl", "El", "Bd", "Ed"}  # macros whose arguments are no text
ROFF_ALTERNATING = {"BR", "RB", "IR", "RI", "BI", "IB"}  # arguments joined without spaces


def roff_unescape(text: str) -> str:
    """`text` with its roff escapes replaced by the characters they print, or dropped."""
    def replace(m: re.Match) -> str:
        if m["glyph"] is not None or m["long"] is not None:
            name = m["glyph"] or m["long"]
            if name in ROFF_GLYPHS:
                return ROFF_GLYPHS[name]
            if re.fullmatch(r"u[0-9A-F]{4,6}", name):
                return chr(int(name[1:], 16))
            if len(name) == 2 and name[0] in ROFF_ACCENTS:
                return unicodedata.normalize("NFC", name[1] + ROFF_ACCENTS[name[0]])
            return ""
        if m["s2"] is not None or m["sl"] is not None or m["s1"] is not None:
            return ROFF_STRINGS.get(m["s2"] or m["sl"] or m["s1"], "")
        if m["delim"] == "N" and m["arg"].isdigit():
            return chr(int(m["arg"]))
        return ROFF_CHARS.get(m["char"], "") if m["char"] is not None else ""
    return ROFF_ESCAPE.sub(replace, text)


def roff_to_text(source: str) -> str:
    """A manual page's roff source as plain text, line for line: comments, requests, macro and
    table definitions dropped; of a macro line only its text arguments kept (a section heading,
    an .IP tag, .B words, .BR words joined); font, size and motion escapes dropped, special
    characters (\\(em, \\[u00E9], \\('e, \\-) written out; a blank line before each paragraph."""
    out: list[str] = []
    skip = None  # "..": inside a macro definition; "format": a table's format lines
    pending = ""
    for raw in source.splitlines():
        line = pending + raw
        if ROFF_CONTINUED.fullmatch(line):
            pending = line[:-1]
            continue
        pending = ""
        comment = ROFF_COMMENT.match(line)
        if comment:
            line = comment[1]
            if not line.strip():
                continue
        if skip == "..":
            skip = None if re.fullmatch(r"[.'][ \t]*\.", line.strip()) else skip
            continue
        if skip == "format":
            skip = None if line.rstrip().endswith(".") else skip
            continue
        request = ROFF_REQUEST.match(line)
        if not request:
            text = re.sub(r"^T\}|T\{$", "", line)  # a table cell's text block markers
            if text.strip() or not line.strip():
                out.append(roff_unescape(text))
            continue
        name, rest = request[1], request[2]
        if name in ROFF_BLOCKS:
            skip = ".."
        elif name == "TS":
            skip = "format"
        if name in ROFF_BREAKS or name == "TS":
            out.append("")
        if name in ROFF_TEXTLESS or not name[:1].isupper():
            continue
        args = [quoted.replace('""', '"') if word is None else word
                for quoted, word in ((m[1], m[2]) for m in ROFF_ARG.finditer(rest))]
        if name == "IP":
            args = args[:1]
        text = "".join(args) if name in ROFF_ALTERNATING else " ".join(args)
        if text.strip():
            out.append(roff_unescape(text))
    text = "\n".join(line.rstrip() for line in out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def files_under(root: Path, wanted: Callable[[str], bool]) -> list[Path]:
    """The regular files (no symbolic links) under `root` whose names are `wanted`, sorted."""
    found = []
    for folder, subdirs, files in os.walk(root):
        subdirs.sort()
        found += [Path(folder, f) for f in files
                  if wanted(f) and not os.path.islink(os.path.join(folder, f))]
    return sorted(found)


def read_text(path: Path) -> str | None:
    """The file's UTF-8 text (a .gz file's decompressed), or None when it is not UTF-8 or cannot
    be read."""
    try:
        data = path.read_bytes()
        return (gzip.decompress(data) if path.name.endswith(".gz") else data).decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError):
        return None


def ranked_texts(root: Path, paths: Iterable[Path], read: Callable[[Path], str | None],
                 key: Callable[[Path], str] | None = None) -> Iterator[tuple[Path, str]]:
    """(path, text) for the files in the order of the hashes of their paths under `root` (a pick
    from all over the tree that is the same for the same files, wherever the tree lies and in
    whatever order it is listed), lazily; skipped: files `read` gives None for, texts shorter
    than MIN_CHARS or longer than MAX_DOC_CHARS, a text taken before, and (with `key`) a file
    whose key a file taken before had."""
    seen = set()
    for path in sorted(paths, key=lambda p: hashlib.sha256(
            p.relative_to(root).as_posix().encode()).hexdigest()):
        text = read(path)
        if text is None or not MIN_CHARS <= len(text) <= MAX_DOC_CHARS:
            continue
        marks = {hashlib.sha256(text.encode()).hexdigest()}
        if key:
            marks.add("key:" + key(path))
        if marks & seen:
            continue
        seen |= marks
        yield path, text


def take(picked: Iterable[tuple[Path, str]], size: int) -> list[tuple[Path, str]]:
    """The first of the picked (path, text) pairs, until they hold at least `size` UTF-8 bytes."""
    out, total = [], 0
    for pair in picked:
        out.append(pair)
        total += len(pair[1].encode())
        if total >= size:
            break
    return out


def round_robin(*iterators: Iterator) -> Iterator:
    """One item from each iterator in turn, leaving out those that are exhausted."""
    live = list(iterators)
    while live:
        for it in list(live):
            try:
                yield next(it)
            except StopIteration:
                live.remove(it)


def man_page_family(path: Path) -> str:
    """A manual page's name up to its first underscore or dot (gcloud_alpha_...1.gz: gcloud)."""
    return re.split(r"[_.]", path.name)[0]


def man_page_text(path: Path) -> str | None:
    source = read_text(path)
    return None if source is None else roff_to_text(source)


def c_header_text(path: Path) -> str | None:
    text = read_text(path)
    return None if text is None or CPLUSPLUS.search(text) else text


def c_headers() -> list[tuple[Path, str]]:
    headers = files_under(INCLUDE, lambda name: name.endswith(".h"))
    return take(ranked_texts(INCLUDE, headers, c_header_text, key=lambda p: p.name), TARGET_BYTES)


def english_man_pages() -> list[tuple[Path, str]]:
    pages = [page for section in range(1, 9)
             for page in files_under(MAN / f"man{section}", lambda name: name.endswith(".gz"))]
    return take(ranked_texts(MAN, pages, man_page_text, key=man_page_family), TARGET_BYTES)


def translated_man_pages() -> list[tuple[Path, str]]:
    languages = sorted(d for d in MAN.iterdir() if d.is_dir() and not d.name.startswith("man"))
    ranked = [ranked_texts(d, files_under(d, lambda name: name.endswith(".gz")), man_page_text,
                           key=man_page_family) for d in languages]
    return take(round_robin(*ranked), TARGET_BYTES)


def documentation_files() -> list[tuple[Path, str]]:
    files = files_under(DOC, lambda name: bool(DOC_NAME.search(name)))
    return take(ranked_texts(DOC, files, read_text), TARGET_BYTES)


def describe(picked: list[tuple[Path, str]], label: Callable[[Path], str], shown: int = 12) -> None:
    """Prints how many of the picked files each label (a folder, a language, a kind) has."""
    counts = sorted(collections.Counter(label(path) for path, _ in picked).items(),
                    key=lambda item: (-item[1], item[0]))
    rest = sum(n for _, n in counts[shown:])
    print("  from " + ", ".join(f"{name} {n}" for name, n in counts[:shown])
          + (f", {len(counts) - shown} others {rest}" if rest else ""))


def doc_kind(path: Path) -> str:
    """A documentation file's kind: README, NEWS, ..., copyright (lowercase), or .txt."""
    kind = DOC_NAME.search(path.name)[1]
    return kind.lower() if kind else ".txt"


def write_texts(folder: Path, docs: list[str]) -> None:
    """Each document as its own NNNN.txt in `folder` (the NNNN.txt files of an earlier build
    there removed first)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("[0-9][0-9][0-9][0-9].txt"):
        old.unlink()
    for i, doc in enumerate(docs):
        (folder / f"{i:04d}.txt").write_text(doc, encoding="utf-8")
    size = sum((folder / f"{i:04d}.txt").stat().st_size for i in range(len(docs)))
    print(f"{folder}: {len(docs)} files, {sum(map(len, docs))} characters, {size} bytes")


def write_jsonl(path: Path, docs: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    size = path.stat().st_size
    print(f"{path}: {len(docs)} documents, {sum(map(len, docs))} characters, {size} bytes")


def build_usr_corpus(out: Path, name: str) -> None:
    """Writes the corpus `name` built from /usr, or says why this machine has none."""
    source, pick, label = USR_CORPORA[name]
    picked = pick() if source.is_dir() else []
    if not picked:
        print(f"skipping {name}/: no usable files under {source} on this machine")
        return
    docs = [text for _, text in picked]
    if name == "plain":
        write_texts(out / name, docs)
    else:
        write_jsonl(out / name / f"{name}.jsonl", docs)
    describe(picked, label)


USR_CORPORA = {  # name: (where its files are, the pick, a file's label for the summary)
    "c": (INCLUDE, c_headers, lambda p: p.relative_to(INCLUDE).parts[0] if p.parent != INCLUDE
          else "(top level)"),
    "man": (MAN, english_man_pages, lambda p: p.relative_to(MAN).parts[0]),
    "intl": (MAN, translated_man_pages, lambda p: p.relative_to(MAN).parts[0]),
    "plain": (DOC, documentation_files, doc_kind),
}
CORPORA = ("prose", "mixture", *USR_CORPORA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the corpora's folders into")
    parser.add_argument("--only", default=",".join(CORPORA),
                        help=f"comma-separated corpora to build (default: {','.join(CORPORA)})")
    args = parser.parse_args()
    only = args.only.split(",")
    unknown = [name for name in only if name not in CORPORA]
    if unknown:
        parser.error(f"unknown corpora {', '.join(unknown)}; choose from {', '.join(CORPORA)}")
    out = args.out
    if "prose" in only or "mixture" in only:
        sources = stdlib_sources()
        prose = topic_documents() + docstring_documents(sources)
        if "prose" in only:
            write_jsonl(out / "prose" / "prose.jsonl", prose)
        if "mixture" in only:
            code = code_documents(sources, sum(map(len, prose)))
            write_jsonl(out / "mixture" / "mixture.jsonl", interleave(prose, code))
    for name in USR_CORPORA:
        if name in only:
            build_usr_corpus(out, name)


if __name__ == "__main__":
    main()
