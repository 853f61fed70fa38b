"""The embedded default corpus (`dataset_path: []`): the pinned snapshot, its checks, its cache
key, and the script that builds it (moebalance.data.default_corpus, tools/make_default_corpus.py)."""

import importlib.util
import io
import lzma
import tarfile
from pathlib import Path

import pytest

from moebalance import data
from moebalance.config import load_config
from moebalance.data import default_corpus
from moebalance.data.tokenizer import fingerprint

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "make_default_corpus.py"
spec = importlib.util.spec_from_file_location("make_default_corpus", TOOL)
make_default_corpus = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_default_corpus)

# the corpus the README's table and docs/results.md's "The A/B on the embedded default" were
# measured on: CPython 3.11.7's standard-library sources. A new snapshot means measuring again.
MEASURED_SHA256 = "fc5fdc4d91ffdd85f971b8cb626a1f573a830091eef78df3e44609a39551be19"


def default_config(**overrides):
    return load_config("deepseek4-tiny", overrides)


def test_default_corpus_is_the_snapshot_the_results_were_measured_on():
    assert default_corpus.SHA256 == MEASURED_SHA256
    assert MEASURED_SHA256 in (ROOT / "docs" / "results.md").read_text()
    docs = data.corpus_documents(default_config())
    assert default_corpus.content_digest((d.name, d.content) for d in docs) == MEASURED_SHA256
    assert (len(docs), sum(d.size for d in docs)) == (1758, 31_512_085)
    assert docs == sorted(docs, key=lambda d: d.path) and all(d.name.endswith(".py") for d in docs)
    assert not any({"site-packages", "dist-packages"} & set(d.name.split("/")) for d in docs)
    assert docs[0].path == default_corpus.ARCHIVE / docs[0].name and not docs[0].path.exists()
    assert "def set_event_loop_policy" in next(d for d in docs if d.name == "asyncio/events.py"
                                               ).text()
    assert default_corpus.LICENCE.read_text().count("PYTHON SOFTWARE FOUNDATION LICENSE") == 1


def test_dataset_glob_picks_among_the_default_corpus_members():
    docs = data.corpus_documents(default_config(dataset_glob="asyncio/*.py"))
    assert len(docs) == 33 and all(d.name.startswith("asyncio/") for d in docs)
    with pytest.raises(data.DataError, match="dataset_glob.*embedded default corpus.*'\\*.txt'"):
        data.corpus_documents(default_config(dataset_glob="*.txt"))


def test_cache_key_follows_the_corpus_digest(monkeypatch):
    cfg = default_config(dataset_glob="json/*.py")
    docs = data.corpus_documents(cfg)
    key = fingerprint(docs, cfg)  # no file is read or stat'ed: the members' paths do not exist
    assert key == sorted((d.name, d.size, MEASURED_SHA256) for d in docs)
    monkeypatch.setattr(default_corpus, "SHA256", "another corpus")
    assert fingerprint(docs, cfg) != key


def test_damaged_or_missing_snapshot_is_an_error_naming_it_and_the_fix(tmp_path):
    archive = tmp_path / "default_corpus.tar.xz"
    good = default_corpus.ARCHIVE.read_bytes()
    for damaged in (good[: len(good) // 50], good[:4096] + bytes([good[4096] ^ 1]) + good[4097:]):
        archive.write_bytes(damaged)
        default_corpus.members.cache_clear()
        with pytest.raises(data.DataError, match=f"{archive} is damaged .*git checkout -- "
                                                 "src/moebalance/data/default_corpus.tar.xz"):
            default_corpus.members(archive)
    with pytest.raises(data.DataError, match=f"{tmp_path / 'gone.tar.xz'} is missing"):
        default_corpus.members(tmp_path / "gone.tar.xz")


def test_altered_snapshot_fails_the_digest_check(tmp_path):
    archive = tmp_path / "default_corpus.tar.xz"
    members = [("a.py", b"x = 1\n"), ("pkg/b.py", b"y = 2\n")]
    make_default_corpus.write_snapshot(members, archive)
    digest = default_corpus.content_digest(members)
    with pytest.raises(data.DataError, match=f"not the one moebalance pins: its content's SHA-256 "
                                             f"is {digest}, not {MEASURED_SHA256}; restore it"):
        default_corpus.members(archive)


def test_content_digest_covers_names_sizes_and_bytes_not_order():
    members = [("a.py", b"x = 1\n"), ("b.py", b"y")]
    digest = default_corpus.content_digest(members)
    assert digest == default_corpus.content_digest(members[::-1])
    for other in ([("a.py", b"x = 1\n"), ("c.py", b"y")], [("a.py", b"x = 1\ny"), ("b.py", b"")],
                  [("a.py", b"x = 1\n")]):
        assert default_corpus.content_digest(other) != digest


# --- tools/make_default_corpus.py --------------------------------------------------------------


def test_snapshot_archive_is_reproducible_and_read_back_whole(tmp_path, monkeypatch):
    members = [("z.py", b"last\n"), ("a/b.py", "caf\u00e9\n".encode()), ("a.py", b"first\n")]
    first, second = tmp_path / "one.tar.xz", tmp_path / "two.tar.xz"
    make_default_corpus.write_snapshot(members, first)
    make_default_corpus.write_snapshot(members[::-1], second)
    assert first.read_bytes() == second.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(first.read_bytes()))) as tar:
        infos = tar.getmembers()
    assert [i.name for i in infos] == ["a.py", "a/b.py", "z.py"]
    assert {(i.mode, i.mtime, i.uid, i.gid, i.uname, i.gname) for i in infos} == {
        (0o644, 0, 0, 0, "", "")}
    monkeypatch.setattr(default_corpus, "SHA256", default_corpus.content_digest(members))
    assert default_corpus.members(first) == tuple(sorted(members))


def test_snapshot_takes_the_stdlib_files_the_old_default_rule_took(tmp_path):
    root = tmp_path / "lib"
    files = {"os.py": b"import sys\n", "json/decoder.py": b"# \xc3\xa9\n", "notes.txt": b"text\n",
             "empty.py": b"", "latin1.py": b"caf\xe9 = 1\n", "site-packages/numpy/core.py": b"x\n",
             "dist-packages/x.py": b"x\n", "test/data/deep.py": b"deep\n"}
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    (root / "zlink.py").symlink_to(root / "os.py")  # a second path to os.py: taken once
    assert make_default_corpus.stdlib_files(root) == [
        ("json/decoder.py", files["json/decoder.py"]), ("os.py", files["os.py"]),
        ("test/data/deep.py", files["test/data/deep.py"])]
