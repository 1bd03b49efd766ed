"""One checkpoint file: tensors and JSON values, stored in the safetensors format.

What a rank saves is a tree of dicts (string keys), lists, strings, numbers, booleans, None and
tensors. The tensors go into a safetensors file, each named by its path in the tree (``rng/tp/0``);
the rest of the tree, with every tensor replaced by ``{"__tensor__": path}``, is JSON in the file's
metadata. Reading a file parses a JSON header and copies bytes: there is no pickle, so a file from
anyone loads without running anything it contains. Tuples come back as lists.

The file is written here, not by ``safetensors.torch.save``, so its bytes stream through the
caller's file object (which hashes them on the way) without a second copy of the shard in memory.
It is read back with plain reads (``RangeFile``), whole or by element range, after every header
field and offset is checked against the file's size; nothing is memory-mapped, which a host may
refuse for a file larger than its RAM. Files written here also read with the safetensors library.
Tensor bytes are stored in the host's order; safetensors specifies little-endian, which every host
that trains with torch is.
"""

from __future__ import annotations

import math
import json
import os
import struct
from typing import Any, BinaryIO, Optional

import torch

TENSOR = "__tensor__"
TREE = "megazero.tree"
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}


class FileFormatError(ValueError):
    """A file is not a readable checkpoint file (not safetensors, or its tree does not match its tensors)."""


def split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON part of ``obj``, with its tensors moved into ``tensors`` under their paths."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in DTYPES:
            raise TypeError(f"{path or 'the saved object'}: tensors of dtype {obj.dtype} cannot be saved "
                            f"(supported: {', '.join(str(d) for d in DTYPES)})")
        tensors[path] = obj
        return {TENSOR: path}
    if isinstance(obj, dict):
        tree = {}
        for key, value in obj.items():
            if not isinstance(key, str) or key == TENSOR:
                raise TypeError(f"{path or 'the saved object'}: dict key {key!r} cannot be saved (keys are "
                                f"strings other than {TENSOR!r})")
            escaped = key.replace("~", "~0").replace("/", "~1")  # JSON-pointer escaping keeps paths unique
            tree[key] = split(value, f"{path}/{escaped}" if path else escaped, tensors)
        return tree
    if isinstance(obj, (list, tuple)):
        return [split(value, f"{path}/{i}" if path else str(i), tensors) for i, value in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{path or 'the saved object'}: a {type(obj).__name__} cannot be saved; checkpoint files "
                    "hold tensors, dicts, lists, strings, numbers, booleans and None")


def header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors file's leading bytes for ``tensors`` (shapes and dtypes only: meta tensors may
    stand in for data written later), their bytes to follow in this order."""
    fields: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        fields[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(fields).encode()
    encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(encoded)) + encoded


def write(obj: Any, f: BinaryIO) -> None:
    """Write ``obj`` to the binary file ``f`` as a safetensors file (see the module docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = json.dumps(split(obj, "", tensors))
    f.write(header(tensors, {TREE: tree}))
    for tensor in tensors.values():
        # Only the tensor's own bytes: a view of a large flat buffer writes the view, not the buffer.
        f.write(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))


class RangeFile:
    """A safetensors file read by element ranges with plain reads. ``safetensors.safe_open`` maps the
    whole file into memory, which a host may refuse for a file larger than its RAM (an 80 GiB
    consolidated 7B checkpoint on a 24 GiB machine: ENOMEM); here only the header and the bytes
    asked for are read. The header is checked against the file's size before anything is used.

    ``source`` is a path, or a binary file already open, which stays its caller's to close: a
    checkpoint file is read through the descriptor its checksum was computed through."""

    MAX_HEADER = 100 * 2**20

    def __init__(self, source: str | os.PathLike | BinaryIO):
        self.owned = isinstance(source, (str, os.PathLike))
        self.f = open(source, "rb") if self.owned else source
        # a path is named in the errors; an open file's caller names it (``load_file``, the reader)
        self.where = f"{os.fspath(source)}: " if self.owned else ""
        try:
            self.f.seek(0)
            size = os.fstat(self.f.fileno()).st_size
            (length,) = struct.unpack("<Q", self.f.read(8).ljust(8, b"\0"))
            if not 0 < length <= min(self.MAX_HEADER, size - 8):
                raise FileFormatError(f"not a safetensors file (header length {length} in a {size}-byte file)")
            fields = json.loads(self.f.read(length))
            if not isinstance(fields, dict):
                raise FileFormatError(f"not a safetensors file (its header is a JSON {type(fields).__name__}, "
                                      "not an object)")
            self.metadata = fields.pop("__metadata__", None) or {}
            if not (isinstance(self.metadata, dict) and all(isinstance(v, str) for v in self.metadata.values())):
                raise FileFormatError("not a safetensors file (its __metadata__ is not an object of strings)")
            self.base = 8 + length
            self.entries = {name: _entry(name, entry, size - self.base) for name, entry in fields.items()}
            _refuse_overlaps(self.entries)
        except (FileFormatError, ValueError, KeyError, TypeError, struct.error, RecursionError) as e:
            self.close()
            if isinstance(e, FileFormatError):
                raise FileFormatError(f"{self.where}{e}") from None
            raise FileFormatError(f"{self.where}not a safetensors file ({type(e).__name__}: {e})") from None

    def keys(self):
        return self.entries.keys()

    def read(self, name: str, start: int = 0, count: Optional[int] = None) -> torch.Tensor:
        """Elements ``start:start+count`` of tensor ``name``, flattened (all of it, shaped, by default).
        A range outside the tensor is refused: its bytes would be another tensor's (a damaged index)."""
        if name not in self.entries:
            raise FileFormatError(f"{self.where}holds no tensor {name!r}")
        dtype, shape, begin, _ = self.entries[name]
        numel = math.prod(shape)
        whole = count is None
        count = numel - start if whole else count
        if not 0 <= start <= start + count <= numel:
            raise FileFormatError(f"{self.where}elements {start}..{start + count} are outside tensor {name!r} "
                                  f"of {numel} elements")
        out = torch.empty(count, dtype=dtype)
        self.f.seek(self.base + begin + start * dtype.itemsize)
        view = memoryview(out.view(torch.uint8).numpy())
        if self.f.readinto(view) != len(view):
            raise FileFormatError(f"{self.where}tensor {name!r} is cut short")
        return out.view(shape) if whole else out

    def close(self) -> None:
        if self.owned:
            self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _entry(name: str, entry: Any, data_size: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """A header entry as (dtype, shape, begin, end), each field checked: a hand-made or damaged
    header must be refused, not read as wrong numbers (a negative dimension or offset, a float)."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise FileFormatError(f"tensor {name!r}: its header entry is not dtype, shape and data_offsets ({entry!r})")
    dtype, shape, offsets = _DTYPE_OF.get(entry["dtype"]), entry["shape"], entry["data_offsets"]
    if dtype is None:
        raise FileFormatError(f"tensor {name!r}: dtype {entry['dtype']!r} is not one of {', '.join(_DTYPE_OF)}")
    if not (isinstance(shape, list) and all(whole(d) for d in shape)):
        raise FileFormatError(f"tensor {name!r}: shape {shape!r} is not a list of whole numbers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(whole(o) for o in offsets)):
        raise FileFormatError(f"tensor {name!r}: data_offsets {offsets!r} are not two whole numbers")
    begin, end = offsets
    if not begin <= end <= data_size or end - begin != math.prod(shape) * dtype.itemsize:
        raise FileFormatError(f"tensor {name!r} does not fit the file ({begin}..{end})")
    return dtype, tuple(shape), begin, end


def _refuse_overlaps(entries: dict[str, tuple]) -> None:
    """Two tensors sharing bytes: one of them would be read as the other's numbers."""
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items() if end > begin)
    for (_, end, name), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise FileFormatError(f"tensors {name!r} and {other!r} overlap in the file")


def read(source: str | os.PathLike | BinaryIO) -> Any:
    """The tree written by ``write``, with tensors on the CPU; ``FileFormatError`` if the file is not one.
    ``source`` as for ``RangeFile``."""
    with RangeFile(source) as f:
        metadata = f.metadata
        tensors = {name: f.read(name) for name in f.keys()}
    if TREE not in metadata:
        raise FileFormatError(f"a safetensors file without the {TREE!r} metadata megazero writes")
    try:
        return join(json.loads(metadata[TREE]), tensors)
    except (ValueError, RecursionError) as e:
        raise FileFormatError(f"its {TREE!r} metadata is damaged ({e})") from None


def join(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``split``: put each referenced tensor back in place."""
    if isinstance(tree, dict):
        if TENSOR in tree:
            name = tree[TENSOR]
            if len(tree) != 1 or not isinstance(name, str) or name not in tensors:
                raise ValueError(f"tensor reference {tree!r} names no tensor of the file")
            return tensors[name]
        return {key: join(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [join(value, tensors) for value in tree]
    return tree
