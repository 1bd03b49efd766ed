"""The shared path checks of ``data_pipeline/paths.py``: an empty path (an unset variable in a
script) is one message naming what was meant and the fix, and each consumer raises it as the error
type its own callers catch; the folders a writer makes, and removes again, are only its own; and
the first bytes of a compressed input say whether it is one."""

from __future__ import annotations

import re

import pytest

from data_pipeline.paths import empty_path_problem
from data_pipeline.tokenizer import load_tokenizer
from megazero.checkpoint.format import CheckpointError, resolve_checkpoint

CURRENT_DIRECTORY = "(it would be read as the current directory)"


def test_an_empty_path_is_one_message_naming_the_thing_and_the_fix():
    assert empty_path_problem("", "checkpoint", "check checkpoint.load") == (
        f"an empty path names no checkpoint {CURRENT_DIRECTORY}; check checkpoint.load")


@pytest.mark.parametrize("path", ["a", ".", " ", "runs/x"])
def test_a_path_that_is_not_empty_is_no_problem(path):
    """Only "" is refused: a blank name is a legal file name, and "." says the current directory on purpose."""
    assert empty_path_problem(path, "checkpoint", "check checkpoint.load") is None


def test_consumers_keep_their_error_types():
    with pytest.raises(FileNotFoundError) as tokenizer:
        load_tokenizer("")
    assert str(tokenizer.value).startswith(f"an empty path names no tokenizer file {CURRENT_DIRECTORY}; give ")
    with pytest.raises(CheckpointError) as checkpoint:
        resolve_checkpoint("", source="the SRC argument")
    assert str(checkpoint.value) == f"an empty path names no checkpoint {CURRENT_DIRECTORY}; check the SRC argument"


def test_preprocess_refuses_an_empty_output_prefix(tmp_path, monkeypatch, capsys):
    """An empty ``--output-prefix`` (an unset variable) names the current folder: a merge wrote hidden
    ``.bin``/``.idx`` files there, preprocessing ``_text_document`` ones. (Planted: no empty check.)"""
    import numpy as np

    from data_pipeline.indexed import IndexedDatasetWriter
    from megazero.cli import main

    with IndexedDatasetWriter(str(tmp_path / "a"), np.uint16) as writer:
        writer.add_document(np.arange(3))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["preprocess", "--merge", str(tmp_path / "a"), "--output-prefix", ""]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"megazero preprocess: error: --output-prefix: an empty path names no shard {CURRENT_DIRECTORY}; give a path "
        "and file-name prefix, e.g. data/corpus"]
    assert list(work.iterdir()) == []


def test_folders_made_part_way_are_removed_and_only_ones_own():
    """``make_folders`` failing at its last level (a name too long) leaves none of the levels it made,
    and ``remove_made`` never removes a folder another job made or wrote into meanwhile. (Planted:
    ``os.makedirs``, which leaves the levels it made; removal up to the nearest existing folder.)"""
    import os
    import tempfile

    from data_pipeline.indexed import IndexedDatasetWriter
    from data_pipeline.paths import make_folders, remove_made

    root = tempfile.mkdtemp()
    with pytest.raises(OSError):
        make_folders(os.path.join(root, "a", "b", "x" * 300))
    assert os.listdir(root) == []
    made = make_folders(os.path.join(root, "a", "b"))
    assert made == [os.path.join(root, "a"), os.path.join(root, "a", "b")]
    open(os.path.join(root, "a", "theirs"), "w").close()  # another job's file beside this one's folder
    remove_made(made)
    assert sorted(os.listdir(root)) == ["a"] and os.listdir(os.path.join(root, "a")) == ["theirs"]
    assert make_folders(root) == []  # nothing to make: nothing to remove later
    long = os.path.join(root, "c", "d", "y" * 300)
    with pytest.raises(OSError, match=rf"^{long}/out: cannot create {long} \(File name too long\); give another"):
        IndexedDatasetWriter(os.path.join(long, "out"), "uint16")
    assert sorted(os.listdir(root)) == ["a"]


def test_a_shard_writer_undoes_only_its_own_files():
    """An abort after ``publish`` removes the files this writer put in place, but not ones another
    run has put at the same paths since; a writer whose temporary file cannot be opened removes the
    folders it made; and a writer finished by hand inside its ``with`` block is not finished twice
    (which failed on its moved files and aborted, deleting the shard). (Planted: unlinking the
    published paths by name; no cleanup when the open fails; no record of what was done.)"""
    import os
    import tempfile

    import numpy as np

    from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter

    root = tempfile.mkdtemp()
    prefix = os.path.join(root, "out")
    first = IndexedDatasetWriter(prefix, np.uint16)
    first.add_document(np.arange(3))
    first.seal()
    first.publish()
    with IndexedDatasetWriter(prefix, np.uint16) as second:  # another run, finishing after it
        second.add_document(np.arange(5))
    first.abort()
    assert list(IndexedDataset(prefix).sizes) == [5]

    with pytest.raises(OSError, match=r"the shard cannot be written \(File name too long\)"):
        IndexedDatasetWriter(os.path.join(root, "new", "deeper", "z" * 300), np.uint16)
    assert sorted(os.listdir(root)) == ["out.bin", "out.idx"]

    with IndexedDatasetWriter(os.path.join(root, "hand"), np.uint16) as writer:
        writer.add_document(np.arange(2))
        writer.seal()
        writer.publish()
    assert list(IndexedDataset(os.path.join(root, "hand")).sizes) == [2]


@pytest.mark.parametrize("head,said", [
    (b"{\"", "not gzip data (it starts with b'{\"'), though named .gz"),  # plain text, however short
    (b"\x1f", "only 1 byte(s), too short for gzip data; the file is truncated"),  # gzip's magic, cut
    (b"\x1f\x8b\x08", "only 3 byte(s), too short for gzip data"),
])
def test_a_short_compressed_file_is_named_for_what_it_is(tmp_path, head, said):
    """A file of fewer than four bytes named ``.gz`` is cut short only where its bytes begin gzip's
    header; otherwise it is no gzip at all. (Planted: every short file called truncated.)"""
    from data_pipeline.sources import check_compression

    path = tmp_path / "x.jsonl.gz"
    path.write_bytes(head)
    with pytest.raises(ValueError, match=re.escape(said)):
        check_compression(str(path))
    (tmp_path / "folder.jsonl.gz").mkdir()
    check_compression(str(tmp_path / "folder.jsonl.gz"))  # a folder is read as a dataset, not here


@pytest.mark.parametrize("name,head,said", [
    ("x.jsonl", b"\x1f\x8b\x08\x00", "x.jsonl: gzip data (it starts with b'\\x1f\\x8b\\x08\\x00'), though not named "
     ".gz, so it would be read as text; rename it x.jsonl.gz"),
    ("x.txt", b"\x28\xb5\x2f\xfd", "x.txt: zstd data (it starts with b'(\\xb5/\\xfd'), though not named .zst, "
     "so it would be read as text; rename it x.txt.zst"),
])
def test_a_compressed_file_without_its_suffix_is_refused(tmp_path, name, head, said):
    """Read as text, a compressed file's bytes are a bad record or two and its documents are lost
    to that count (a curation run went on without them). (Planted: only compressed names checked.)"""
    from data_pipeline.sources import check_compression

    path = tmp_path / name
    path.write_bytes(head + b"rest of the stream")
    with pytest.raises(ValueError, match=re.escape(said)):
        check_compression(str(path))
    path.write_bytes(b'{"text": "plain"}\n')
    check_compression(str(path))
    (tmp_path / "x.parquet").write_bytes(head)  # left to the parquet footer's own check
    check_compression(str(tmp_path / "x.parquet"))


def test_an_output_under_a_dangling_link_says_so(tmp_path):
    """The nearest existing path above an output is a link to nothing: said as such, not as "a file".
    (Planted: every non-folder called a file.)"""
    import os

    from data_pipeline.paths import output_folder_problem

    os.symlink(tmp_path / "gone", tmp_path / "link")
    assert output_folder_problem(str(tmp_path / "link" / "out")) == \
        f"{tmp_path / 'link'} is a link to {tmp_path / 'gone'}, which does not exist"
    assert output_folder_problem(str(tmp_path / "new" / "out")) is None and os.listdir(tmp_path) == ["link"]
