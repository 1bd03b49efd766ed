"""Loading a checkpoint runs no code and trusts nothing unchecked: files are safetensors whose JSON tree
round-trips exactly, a pickle (with a payload, or the old format 1) is refused, COMPLETE checks its
own content, a damaged ``latest`` pointer falls back to the scan, and the bytes loaded are the bytes
checked: a file replaced or rewritten after its check is refused, never read unchecked."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Optional

import pytest
import torch

from megazero.checkpoint import (
    CheckpointError, CheckpointWriter, latest_checkpoint, list_checkpoints, load_file, read_manifest,
    resolve_checkpoint,
    verify_checkpoint,
)
from megazero.checkpoint import serialization
from megazero.checkpoint.format import COMPLETE, FileIdentity, complete_text, confirm_unchanged, verify_file


def alone() -> None:
    """The barrier of a one-rank world."""


def write_read(tmp_path: Path, obj):
    path = tmp_path / "f.safetensors"
    with open(path, "wb") as f:
        serialization.write(obj, f)
    return serialization.read(path), path


# --- the file format ----------------------------------------------------------------------------

def test_every_dtype_and_shape_round_trips_bit_for_bit(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {str(dtype): (torch.randn(3, 5, generator=gen) * 100).to(dtype) for dtype in serialization.DTYPES}
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["transposed"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    tensors["rng"] = torch.get_rng_state()
    loaded, _ = write_read(tmp_path, tensors)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name


def test_json_values_round_trip_exactly_and_tuples_become_lists(tmp_path):
    """Tensors are stored under their path in the tree, so a key holding a slash must not name the
    same path as a nested key. (Planted: keys left unescaped, so ``{"a/b": x, "a": {"b": y}}`` stored
    one tensor and loaded it for both.)"""
    tree = {"adam_step": 0.1 + 0.2, "big": 2**70, "inf": float("inf"), "flag": True, "none": None, "text": "é/~",
            "params": [("a.weight", (4, 2), None), ("b", (3,), (0, 1, 2))],
            "keys/with~slashes": {"a/b": torch.ones(2), "a~1b": torch.zeros(2), "a": {"b": torch.full((2,), 3.0)}}}
    loaded, _ = write_read(tmp_path, tree)
    assert loaded["adam_step"] == 0.1 + 0.2 and loaded["big"] == 2**70 and loaded["inf"] == float("inf")
    assert loaded["params"] == [["a.weight", [4, 2], None], ["b", [3], [0, 1, 2]]]
    assert (loaded["flag"], loaded["none"], loaded["text"]) == (True, None, "é/~")
    nested = loaded["keys/with~slashes"]
    assert torch.equal(nested["a/b"], torch.ones(2)) and torch.equal(nested["a~1b"], torch.zeros(2))
    assert torch.equal(nested["a"]["b"], torch.full((2,), 3.0))


def test_files_are_plain_safetensors(tmp_path):
    """Readable by the safetensors library, with the tensor data starting 8-byte aligned as it writes
    it (so a memory map gives aligned tensors). (Planted: the header left unpadded; padded by its length
    modulo 8 instead of up to the next multiple.)"""
    from safetensors.torch import load_file as safetensors_load

    tree = {"master": torch.arange(6.0), "rng": {"tp": [None, torch.ones(3, dtype=torch.uint8)]}}
    _, path = write_read(tmp_path, tree)
    assert set(safetensors_load(path)) == {"master", "rng/tp/1"}
    for extra in range(8):  # a header of every length modulo 8 is padded to the next multiple
        _, path = write_read(tmp_path, {"m" * (1 + extra): torch.arange(6.0)})
        assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0, extra


@pytest.mark.parametrize("value, words", [
    ({1: torch.ones(1)}, "dict key 1"),
    ({"s": {1, 2}}, "s: a set cannot be saved"),
    ({"c": [torch.ones(2, dtype=torch.complex64)]}, "c/0: tensors of dtype torch.complex64"),
    ({"__tensor__": "x"}, "dict key '__tensor__'"),
])
def test_values_outside_tensors_and_json_are_refused_when_saved(value, words):
    with pytest.raises(TypeError, match=words):
        serialization.write(value, io.BytesIO())


def rewrite_header(data: bytes, change) -> bytes:
    """A safetensors file's bytes with its JSON header replaced by ``change(header)`` (text, or JSON)."""
    length = int.from_bytes(data[:8], "little")
    header = change(json.loads(data[8:8 + length]))
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + length:]


def _set(field, value, tensor="a"):
    return lambda header: {**header, tensor: {**header[tensor], field: value}}


@pytest.mark.parametrize("change, words", [
    (lambda header: [header], "its header is a JSON list, not an object"),
    (lambda header: b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
    (lambda header: {**header, "__metadata__": {serialization.TREE: 5}}, "__metadata__ is not an object of strings"),
    (_set("shape", [-6, -4]), "shape [-6, -4] is not a list of whole numbers"),  # the same element count
    (_set("shape", [6.0, 4]), "shape [6.0, 4] is not a list of whole numbers"),
    (_set("dtype", "F8"), "dtype 'F8' is not one of"),
    (_set("data_offsets", [96, 192, 0]), "data_offsets [96, 192, 0] are not two whole numbers"),
    (_set("data_offsets", [0.0, 96]), "data_offsets [0.0, 96] are not two whole numbers"),
    (_set("data_offsets", [95, 191], tensor="b"), "tensors 'a' and 'b' overlap in the file"),  # by one byte
    (lambda header: {**header, "a": {**header["a"], "extra": 1}}, "not dtype, shape and data_offsets"),
])
def test_a_damaged_or_hand_made_header_is_refused_naming_the_file(tmp_path, change, words):
    """Every field of a header is checked before a byte is read: a shape, dtype or offset that does
    not describe the bytes, or two tensors sharing bytes, would read as wrong numbers, and a header
    that is not an object as a traceback."""
    _, path = write_read(tmp_path, {"a": torch.ones(6, 4), "b": torch.zeros(6, 4)})
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(rewrite_header(path.read_bytes(), change))
    with pytest.raises(serialization.FileFormatError) as error:
        serialization.read(bad)
    assert str(error.value).startswith(f"{bad}: ") and words in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name, start, count", [("a", 20, 5), ("a", -1, 2), ("a", 3, -1), ("c", 0, 1)])
def test_a_range_read_outside_its_tensor_is_refused(tmp_path, name, start, count):
    """A range past a tensor's end would read the next tensor's bytes: a damaged shard index asking for
    it gets an error naming the file, not another tensor's numbers."""
    _, path = write_read(tmp_path, {"a": torch.ones(6, 4), "b": torch.zeros(6, 4)})
    with serialization.RangeFile(path) as f, pytest.raises(serialization.FileFormatError, match=f"^{path}: "):
        f.read(name, start, count)
    with serialization.RangeFile(path) as f:
        assert torch.equal(f.read("a", 20, 4), torch.ones(4))


# --- code in a file is never run ----------------------------------------------------------------

class RunsCode:
    """Unpickling this runs ``exec``: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def forge(ckpt: Path, name: str, data: bytes) -> None:
    """Replace a file of a checkpoint and fix up COMPLETE, as whoever can write the files can."""
    (ckpt / name).write_bytes(data)
    record = json.loads((ckpt / "COMPLETE").read_text())
    record["files"][name].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "COMPLETE").write_text(complete_text(record))


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture
def saved(tmp_path) -> Path:
    CheckpointWriter(tmp_path / "root", rank=0, world_size=1, barrier=alone).save(
        4, {"model.pt": {"w": torch.ones(3)}, "other.pt": {"w": torch.zeros(2)}}, meta={"consumed": 320})
    return tmp_path / "root" / "step_0000004"


@pytest.mark.parametrize("verify", [True, False])
def test_a_file_that_would_run_code_is_refused_and_the_code_never_runs(saved, tmp_path, verify):
    marker = tmp_path / "code_ran"
    forge(saved, "model.pt", pickled({"w": torch.ones(3), "payload": RunsCode(marker)}))
    verify_checkpoint(saved)  # the checksums match: they catch damage, not a forger
    with pytest.raises(CheckpointError) as error:
        load_file(saved, "model.pt", verify=verify)
    message = str(error.value)
    assert message.startswith(f"{saved / 'model.pt'}: not a safetensors file") and "\n" not in message
    assert not marker.exists()


@pytest.mark.parametrize("metadata, words", [
    ({serialization.TREE: '{"w": {"__tensor__": "v"}}'}, "its 'megazero.tree' metadata is damaged"),
    ({serialization.TREE: '{"w": {"__tensor__": "w", "x": 1}}'}, "its 'megazero.tree' metadata is damaged"),
    ({}, "a safetensors file without the 'megazero.tree' metadata"),  # written by another tool
    ({serialization.TREE: "[" * 100_000 + "]" * 100_000}, "its 'megazero.tree' metadata is damaged"),
], ids=["missing-tensor", "beside-a-tensor", "no-tree", "too-deep"])
def test_a_file_whose_tree_does_not_match_its_tensors_is_refused_in_one_line(saved, metadata, words):
    """A tree naming a tensor the file lacks, a value beside a tensor's reference (which the load
    would drop), or no tree at all is a damaged file, refused in one line naming it."""
    buffer = io.BytesIO()
    serialization.write({"w": torch.ones(1)}, buffer)
    forge(saved, "model.pt", rewrite_header(buffer.getvalue(), lambda header: {**header, "__metadata__": metadata}))
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(saved / 'model.pt'))}: {words}"):
        load_file(saved, "model.pt")


def test_format_1_checkpoints_of_pickles_are_refused_with_the_reason(tmp_path):
    marker = tmp_path / "code_ran"
    ckpt = tmp_path / "step_0000001"
    ckpt.mkdir()
    data = pickled({"payload": RunsCode(marker)})
    (ckpt / "rank_00000.pt").write_bytes(data)
    (ckpt / "COMPLETE").write_text(json.dumps({"format": 1, "step": 1, "world_size": 1, "meta": {}, "files": {
        "rank_00000.pt": {"rank": 0, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}))
    assert resolve_checkpoint(tmp_path) == ckpt  # still found...
    for load in (read_manifest, lambda c: load_file(c, "rank_00000.pt")):
        with pytest.raises(CheckpointError, match="COMPLETE: checkpoint format 1 stores pickled Python objects, "
                                                  "which can run code when loaded, so it is not read"):
            load(ckpt)  # ...but never unpickled
    assert not marker.exists()


def test_a_checkpoint_of_a_newer_format_is_refused(saved):
    """A format this release does not know (written by a newer one) is refused naming both formats,
    not read as if it were format 2."""
    record = json.loads((saved / "COMPLETE").read_text())
    (saved / "COMPLETE").write_text(complete_text({**record, "format": 3}))
    with pytest.raises(CheckpointError, match="COMPLETE: checkpoint format 3 is not the supported format 2"):
        read_manifest(saved)


# --- COMPLETE checks itself ---------------------------------------------------------------------

def test_complete_carries_its_own_checksum(saved):
    assert read_manifest(saved)["meta"] == {"consumed": 320}
    text = (saved / "COMPLETE").read_text()
    (saved / "COMPLETE").write_text(text.replace('"consumed": 320', '"consumed": 328'))
    with pytest.raises(CheckpointError, match="COMPLETE: its content does not match its own sha256"):
        read_manifest(saved)
    with pytest.raises(CheckpointError, match="does not match its own sha256"):
        load_file(saved, "other.pt")


@pytest.mark.parametrize("change, what", [
    (lambda r: r.update(world_size="x"), "step 4 and world_size 'x' must be whole numbers"),
    (lambda r: r.update(step=-1), "step -1 and world_size 1 must be whole numbers"),
    (lambda r: r.update(world_size=0), "step 4 and world_size 0 must be whole numbers"),  # a world has a rank
    (lambda r: r.pop("files"), "meta and files must be JSON objects"),
    (lambda r: r["files"]["model.pt"].pop("sha256"), "file 'model.pt' must have a rank, a size in bytes and a sha256"),
])
def test_a_resealed_record_of_the_wrong_shape_is_refused(saved, change, what):
    """A record edited and given a fresh checksum (or written by a tool that got the format wrong)
    reached the readers as a traceback (int('x'), KeyError 'files')."""
    record = json.loads((saved / "COMPLETE").read_text())
    del record["sha256"]
    change(record)
    (saved / "COMPLETE").write_text(complete_text(record))
    with pytest.raises(CheckpointError, match=re.escape(f"COMPLETE: {what}") + ".*not a record megazero writes"):
        read_manifest(saved)


def test_complete_without_its_checksum_is_refused(saved):
    record = json.loads((saved / "COMPLETE").read_text())
    del record["sha256"]
    (saved / "COMPLETE").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="does not match its own sha256"):
        read_manifest(saved)


# --- the latest pointer -------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"\xff\xfestep_0000004\n", b"step_0000004\x00\n", b"../../etc\n", b""])
def test_a_damaged_latest_pointer_falls_back_to_the_scan_with_a_warning(saved, capsys, content):
    root = saved.parent
    CheckpointWriter(root, rank=0, world_size=1, barrier=alone).save(2, {"m.pt": {"w": torch.ones(1)}})
    (root / "latest").write_bytes(content)
    assert latest_checkpoint(root) == saved  # the newest complete one, step 4 (the save of step 2 came later)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1, (out, err)  # stdout is generate's text
    assert lines[0].startswith(f"megazero: warning: {root / 'latest'}: damaged checkpoint pointer")
    assert resolve_checkpoint(root) == saved


@pytest.mark.parametrize("pointer, state", [("step_0000002", "is older"),
                                            ("step_0000009", "is not a complete checkpoint")])
def test_a_pointer_behind_the_newest_checkpoint_loses_to_it_with_a_warning(saved, capsys, pointer, state):
    """A save cut between its rename and the pointer's update leaves ``latest`` on the step before:
    resuming there would retrain the steps since and save over the newer checkpoint."""
    root = saved.parent
    CheckpointWriter(root, rank=0, world_size=1, barrier=alone).save(2, {"m.pt": {"w": torch.ones(1)}})
    (root / "latest").write_text(pointer + "\n")
    capsys.readouterr()
    assert latest_checkpoint(root) == saved  # step 4
    out, err = capsys.readouterr()
    assert out == "" and err == (f"megazero: warning: {root / 'latest'} names {pointer}, which {state}; using "
                                 f"step_0000004, the newest complete checkpoint in {root} (to go back to an older "
                                 "one, move the newer ones out of it)\n")
    (root / "latest").write_text("step_0000004\n")
    assert latest_checkpoint(root) == saved and capsys.readouterr().err == ""


def test_steps_past_seven_digits_are_ordered_by_number(tmp_path):
    """step_10000000 sorts before step_9999999 by name: a resume would take the older one."""
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone)
    for step in (9_999_999, 10_000_000):
        writer.save(step, {"m.pt": {"w": torch.ones(1)}})
    (tmp_path / "latest").unlink()
    assert [p.name for _, p in list_checkpoints(tmp_path)] == ["step_9999999", "step_10000000"]
    assert latest_checkpoint(tmp_path).name == "step_10000000"


def test_a_missing_pointer_falls_back_silently(saved, capsys):
    (saved.parent / "latest").unlink()
    assert latest_checkpoint(saved.parent) == saved
    assert capsys.readouterr().out == ""


# --- the bytes checked are the bytes read -------------------------------------------------------

def flipped(path: Path) -> bytes:
    """The file's bytes with its last byte (tensor data, not the header) changed: another file of
    the same size, as a later save of the same step would be."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    return bytes(data)


def swap_after_hashing(monkeypatch, path: Path, in_place: bool = False, keep_time: bool = False,
                       replacement: Optional[bytes] = None) -> None:
    """Once ``path`` is hashed, another file of its size is there: renamed over it (a re-save swapping
    the step directory, retention deleting it and a new save reusing the name), or, ``in_place``,
    written into it. Its modification time is set back first, so that the write is seen whatever the
    clock's resolution; ``keep_time`` gives the file renamed over it that time too (a copy that keeps
    times, as ``cp -p`` or ``rsync -a`` make), so that only its inode tells it apart. The other file's
    bytes are ``replacement``, or by default ``path``'s with its last byte changed."""
    from megazero.checkpoint import format as checkpoint_format

    digest, other = checkpoint_format.file_digest, flipped(path) if replacement is None else replacement
    os.utime(path, ns=(0, 0))

    def hashing_then_swapping(f):
        nonlocal other
        result = digest(f)
        if Path(f.name) == path and other is not None:
            if in_place:
                with open(path, "r+b") as out:
                    out.write(other)
            else:
                (path.parent / "replacement").write_bytes(other)
                if keep_time:
                    os.utime(path.parent / "replacement", ns=(0, 0))
                os.replace(path.parent / "replacement", path)
            other = None  # once
        return result
    monkeypatch.setattr(checkpoint_format, "file_digest", hashing_then_swapping)


def test_a_file_swapped_after_its_check_loads_the_bytes_checked(saved, monkeypatch):
    """The file is parsed through the descriptor it was hashed through (planted: ``load_file``
    opening the path again after ``verify_file``, which read the swapped-in file unchecked)."""
    swap_after_hashing(monkeypatch, saved / "model.pt")
    assert torch.equal(load_file(saved, "model.pt")["w"], torch.ones(3))


def test_a_file_rewritten_after_its_check_is_refused(saved, monkeypatch):
    """A write into the very file hashed lands in what is parsed: the descriptor's modification time
    tells (planted: no identity check after the read)."""
    path = saved / "model.pt"
    swap_after_hashing(monkeypatch, path, in_place=True)
    with pytest.raises(CheckpointError) as error:
        load_file(saved, "model.pt")
    assert str(error.value).startswith(f"{path}: the checkpoint changed while it was read")


def reader_checkpoint(root: Path, segments=((0, 0, 0, 4), (1, 0, 4, 4))) -> Path:
    """A one-rank checkpoint of two parameters, ``a`` and ``b``, which the reader reads one opening
    of the rank file each; ``segments`` as a rank describes them (param, param offset, shard offset,
    count)."""
    from megazero.checkpoint.reader import index_file, rank_file

    flat = torch.arange(8.0)
    files = {rank_file(0): {"master": flat, "exp_avg": flat * 2, "exp_avg_sq": flat * 3, "adam_step": 1},
             index_file(0): {"params": [["a", [4], None], ["b", [4], None]],
                             "segments": torch.tensor(segments)}}
    CheckpointWriter(root, rank=0, world_size=1, barrier=alone).save(1, files)
    return root / "step_0000001"


@pytest.mark.parametrize("in_place, keep_time", [(False, False), (True, False), (False, True)])
def test_range_reads_refuse_a_rank_file_swapped_after_its_check(tmp_path, monkeypatch, in_place, keep_time):
    """The reader (resharding loads, ``megazero generate``, ``megazero convert``) hashes a rank file
    at its first opening and reads the first tensor through that descriptor; every later opening must
    find that very file, and is refused before any of another file is parsed (planted: the reader
    opening the path again after ``verify_file``, which read ``b`` from the swapped-in file; the
    identity compared after the reads only; the inode left out of it, which let a copy keeping its
    size and time through)."""
    from megazero.checkpoint.reader import CheckpointReader, rank_file

    ckpt = reader_checkpoint(tmp_path)
    reader = CheckpointReader(ckpt)
    swap_after_hashing(monkeypatch, ckpt / rank_file(0), in_place, keep_time)
    if not in_place:
        assert torch.equal(reader.read("a")["master"], torch.arange(4.0))
    parsed, range_file = [], serialization.RangeFile
    monkeypatch.setattr(serialization, "RangeFile", lambda f: parsed.append(f) or range_file(f))
    with pytest.raises(CheckpointError) as error:
        reader.read("b")
    assert str(error.value).startswith(f"{ckpt / rank_file(0)}: the checkpoint changed while it was read")
    assert len(parsed) == in_place  # rewritten in place, the change shows once the reads are done


@pytest.mark.parametrize("by", ["load_file", "reader"])
def test_a_file_rewritten_unreadable_after_its_check_is_named_as_changed(tmp_path, monkeypatch, by):
    """A rewrite that lands in the header fails the parse: the file changed, it is not damage to
    restore from a backup (planted: the parse error reported first, which told the user to restore a
    checkpoint that a run was re-saving)."""
    from megazero.checkpoint.reader import CheckpointReader, rank_file

    ckpt = reader_checkpoint(tmp_path)
    path = ckpt / rank_file(0)
    swap_after_hashing(monkeypatch, path, in_place=True, replacement=bytes(path.stat().st_size))
    with pytest.raises(CheckpointError) as error:
        load_file(ckpt, rank_file(0)) if by == "load_file" else CheckpointReader(ckpt).read("a")
    assert str(error.value).startswith(f"{path}: the checkpoint changed while it was read")


@pytest.mark.parametrize("field", FileIdentity._fields)
def test_a_file_differing_in_any_part_of_its_identity_is_refused(saved, field):
    """Device, inode, size and modification time each tell a checked file from another (planted: the
    size left out of the comparison, which no swap above tells on its own)."""
    path = saved / "model.pt"
    with open(path, "rb") as f:
        identity = FileIdentity.of(f)
        confirm_unchanged(f, path, identity)
        with pytest.raises(CheckpointError, match="changed while it was read"):
            confirm_unchanged(f, path, identity._replace(**{field: getattr(identity, field) + 1}))


def test_a_size_only_check_does_not_stand_for_a_hash(saved):
    """A file checked for its size alone is not recorded as hashed: a later load sharing the record
    hashes it (planted: every check recorded, which loaded a damaged file of the right size)."""
    path, checked = saved / "model.pt", {}
    path.write_bytes(flipped(path))
    verify_file(saved, "model.pt", read_manifest(saved)["files"]["model.pt"], sha256=False, checked=checked)
    assert checked == {}
    with pytest.raises(CheckpointError, match="does not match the manifest's"):
        load_file(saved, "model.pt", checked=checked)


def test_a_rank_file_the_record_does_not_list_is_refused_in_one_line(tmp_path):
    """Shard descriptions naming a rank whose file ``COMPLETE`` does not list (a record resealed by
    hand) are refused as a damaged checkpoint, not read against no entry (planted: the listing left
    unchecked, a TypeError from inside the check)."""
    from megazero.checkpoint.reader import CheckpointReader, rank_file

    ckpt = reader_checkpoint(tmp_path)
    record = json.loads((ckpt / COMPLETE).read_text())
    del record["files"][rank_file(0)]
    (ckpt / COMPLETE).write_text(complete_text(record))
    with pytest.raises(CheckpointError, match=f"{rank_file(0)} is not listed in {ckpt / COMPLETE}; the checkpoint"):
        CheckpointReader(ckpt).read("a")


@pytest.mark.parametrize("segments, words", [
    ([[0, 0, 0, 4], [1, 0, 4, 3]], "the rank files hold only part of parameter 'b'"),
    ([[0, 0, 0, 4], [1, 0, 4, 4], [1, 3, 4, 2]], "its shard description is damaged (segment (1, 3, 2) lies outside"),
    ([[0, 0, 0, 4], [1, 0, 6, 4]], "elements 6..10 are outside tensor 'master'"),
], ids=["short", "past-its-parameter", "past-the-shard"])
def test_a_hand_made_shard_description_is_refused_not_read_as_other_numbers(tmp_path, segments, words):
    """A segment the parameter does not end with, one past the parameter's end (a traceback), or one
    past the end of the flat shard (which read the next tensor's bytes, Adam's first moment, as
    weights) is refused in one line naming the file."""
    from megazero.checkpoint.reader import CheckpointReader

    ckpt = reader_checkpoint(tmp_path, segments)
    with pytest.raises(CheckpointError, match=re.escape(words)) as error:
        CheckpointReader(ckpt).read("b")
    assert str(error.value).startswith(str(ckpt)) and "\n" not in str(error.value)


def test_a_rank_file_without_an_entry_a_load_needs_is_refused_naming_it(tmp_path):
    """A rank file lacking an entry (random generators, an older writer's file) is refused naming the
    entry, not read as None: a resharded resume would skip restoring its generators in silence."""
    from megazero.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(reader_checkpoint(tmp_path))
    assert reader.values(0, ("adam_step",)) == {"adam_step": 1}
    with pytest.raises(CheckpointError, match="rank_00000.safetensors: holds no entry 'rng'; it was not written by"):
        reader.values(0, ("adam_step", "rng"))


@pytest.mark.parametrize("entry, value, words", [
    ("adam_step", "four", "its entry 'adam_step' is a str, which megazero never writes there"),
    ("adam_step", True, "its entry 'adam_step' is a bool"), ("scaler", [1], "its entry 'scaler' is a list"),
    ("rng", None, "holds no entry 'rng'")])
def test_a_rank_files_entries_are_checked_before_a_load_uses_them(tmp_path, entry, value, words):
    """A rank file whose record checks out (sealed again by hand, or another tool's) with an entry of
    another type, or none, stopped a resume with a TypeError or KeyError from deep in the load: the
    exact load and the resharded one check what they read. (Planted: no check.)"""
    from megazero.checkpoint.reader import CheckpointReader, rank_file
    from megazero.checkpoint.state import RANK_ENTRIES, checked_entries

    good = {**{key: torch.zeros(2) for key in ("master", "exp_avg", "exp_avg_sq")}, "params": [],
            "segments": torch.zeros((0, 4), dtype=torch.int64),
            "adam_step": 3.0, "scaler": {"kind": "NoScaler"}, "rng": {"cpu": torch.zeros(2)}}
    assert checked_entries(tmp_path / "f", good, RANK_ENTRIES) is good
    bad = {k: v for k, v in good.items() if k != entry or value is not None}
    if value is not None:
        bad[entry] = value
    with pytest.raises(CheckpointError, match=re.escape(words)):
        checked_entries(tmp_path / "f", bad, RANK_ENTRIES)
    CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone).save(1, {rank_file(0): bad})
    from megazero.checkpoint.state import _values

    with pytest.raises(CheckpointError, match=re.escape(words)):
        _values(CheckpointReader(tmp_path / "step_0000001"), 0, entry)
