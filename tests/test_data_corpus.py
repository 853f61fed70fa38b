"""The corpus (files; the embedded default corpus is tests/test_default_corpus.py's) and the
train/held-out split by document hash: moebalance.data.corpus."""

import os
import random
from pathlib import Path

import pytest

from data_fixtures import corpus, needs_permissions, text_config  # noqa: F401 (corpus)
from moebalance import data


def test_corpus_files_sorted_and_skips_empty_and_non_utf8(tmp_path, corpus):
    root, docs = corpus
    files = data.corpus_files(text_config(tmp_path, root))
    assert files == sorted(root / name for name in docs)


def test_split_is_deterministic_order_independent_and_covers_each_document_once(tmp_path, corpus):
    root, _ = corpus
    docs = data.corpus_documents(text_config(tmp_path, root))
    train, held = data.split_documents(docs, 0.3, seed=0)
    shuffled = docs[::-1]
    random.Random(1).shuffle(shuffled)
    assert data.split_documents(shuffled, 0.3, seed=0) == (train, held)
    assert sorted(train + held, key=lambda d: d.path) == docs and not set(train) & set(held)


def test_split_of_a_document_depends_only_on_its_name_and_the_seed():
    docs = [data.Document(f"pkg/d{i}.py", Path(f"/corpus/pkg/d{i}.py")) for i in range(400)]
    _, held = data.split_documents(docs, 0.25, seed=7)
    assert 0.18 < len(held) / len(docs) < 0.32
    _, sub_held = data.split_documents(docs[100:300], 0.25, seed=7)
    assert set(sub_held) == set(held) & set(docs[100:300])
    moved = [data.Document(d.name, Path("/elsewhere") / d.name) for d in docs]
    assert [d.name for d in data.split_documents(moved, 0.25, seed=7)[1]] == [d.name for d in held]
    assert data.split_documents(docs, 0.25, seed=8)[1] != held


@pytest.mark.parametrize("fraction", [1e-9, 1 - 1e-9])
def test_split_keeps_a_document_on_each_side(tmp_path, corpus, fraction):
    root, _ = corpus
    docs = data.corpus_documents(text_config(tmp_path, root))
    train, held = data.split_documents(docs, fraction, seed=3)
    assert len(train) >= 1 and len(held) >= 1 and len(train) + len(held) == len(docs)


# --- errors ----------------------------------------------------------------------------------


def test_empty_corpus_is_an_error(tmp_path):
    root = tmp_path / "nothing"
    root.mkdir()
    (root / "empty.py").write_text("")
    (root / "bytes.py").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(data.DataError, match="dataset_path.*dataset_glob"):
        data.corpus_files(text_config(tmp_path, root))


def test_an_empty_named_file_is_called_empty(tmp_path):
    """A file named in dataset_path is no match of dataset_glob: the error says what is wrong
    with the file itself."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(data.DataError) as err:
        data.corpus_files(text_config(tmp_path, tmp_path / "empty.jsonl"))
    assert str(err.value) == (f"config key `dataset_path`: {tmp_path / 'empty.jsonl'} is empty; "
                              "give files that hold text")
    with pytest.raises(data.DataError, match=r"empty.jsonl is empty; .*latin1.txt is not UTF-8"):
        data.corpus_files(text_config(tmp_path, tmp_path / "empty.jsonl", dataset_path=[
            str(tmp_path / "empty.jsonl"), str(tmp_path / "latin1.txt")]))


def test_missing_path_is_an_error(tmp_path, corpus):
    root, _ = corpus
    with pytest.raises(data.DataError, match="nowhere.*does not exist"):
        data.corpus_files(text_config(tmp_path, root, dataset_path=[str(root),
                                                                    str(tmp_path / "nowhere")]))


def test_single_document_is_an_error(tmp_path):
    (tmp_path / "one.py").write_text("only one document here\n")
    with pytest.raises(data.DataError, match="at least 2 files"):
        data.TextBatches(text_config(tmp_path, tmp_path / "one.py"), "train")


@needs_permissions
def test_unreadable_file_or_directory_is_an_error(tmp_path, corpus):
    root, docs = corpus
    (root / next(iter(docs))).chmod(0)
    with pytest.raises(data.DataError, match="dataset_path.*cannot read .*mod_0.py .*chmod"):
        data.corpus_files(text_config(tmp_path, root))
    root.chmod(0)
    with pytest.raises(data.DataError, match="dataset_path.*corpus' cannot be read \\(permission "
                                             "denied; chmod a\\+rX"):
        data.corpus_files(text_config(tmp_path, root))


@pytest.mark.parametrize("make, problem", [
    (lambda p: os.mkfifo(p), "is not a regular file \\(a device, pipe or socket\\)"),
    (lambda p: p.symlink_to(p.parent / "gone"), "is a link to .*gone, which does not exist"),
    (lambda p: None, "does not exist"),
])
def test_a_named_path_that_cannot_be_read_says_why(tmp_path, corpus, make, problem):
    """A pipe was called missing ("does not exist") before: each entry's problem is named."""
    root, _ = corpus
    make(tmp_path / "entry")
    with pytest.raises(data.DataError, match=f"^config key `dataset_path`: '.*entry' {problem}; "
                                             "give existing files or directories"):
        data.corpus_files(text_config(tmp_path, root, dataset_path=[str(root),
                                                                    str(tmp_path / "entry")]))


def test_permission_problems_are_named_whoever_runs_the_tests(tmp_path, monkeypatch):
    """paths.problem's refusals of permission, made to happen for root too (root reads files of
    mode 000): a directory that cannot be listed, a file that cannot be opened, a path below a
    directory that cannot be searched."""
    from moebalance import paths

    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    assert paths.problem(tmp_path / "dir", "either") is None
    assert paths.problem(tmp_path / "file") is None
    monkeypatch.setattr(os, "scandir", refuse)
    assert paths.problem(tmp_path / "dir", "either") == paths.UNREADABLE
    monkeypatch.setattr(Path, "open", refuse)
    assert paths.problem(tmp_path / "file") == paths.UNREADABLE
    monkeypatch.setattr(Path, "stat", refuse)
    assert paths.problem(tmp_path / "file") == ("cannot be reached (permission denied on a "
                                                "directory above it)")
