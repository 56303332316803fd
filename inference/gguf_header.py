"""A GGUF file's header (llama.cpp's format): its metadata and its tensor index, read from the file's
memory mapping.

Not the gguf package's GGUFReader: it builds a numpy view of every vocabulary entry and merge, most of a
150k-token vocabulary's load time (docs/benchmarks.md, Weight formats), and a model needs none of them
(transformers builds the tokenizer from the file). Here those arrays are stepped over and only their
lengths kept. Values are what GGUFReader's `contents()` gives: Python scalars, str, lists.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value type -> struct format; 8 is a string (u64 length, UTF-8 bytes), 9 an array (type, u64 count, items)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# ggml types whose tensors are typed arrays; every other type is held as uint8 block rows, as GGUFReader does
ARRAY_DTYPES = {
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: shape[0] is a row's length
    n_bytes: int
    data_offset: int  # in the file
    data: np.ndarray  # a view of the mapping, numpy's order: typed, or uint8 [..., rows, row bytes]


@dataclass(frozen=True)
class Header:
    """What is kept of a parsed file: its metadata values, its tensors (memory-mapped) and where their data
    starts. Of the arrays named by read_header's `skipped`, only their lengths (a Python string per token
    and merge would be another 140 MiB for a 128k vocabulary)."""

    fields: dict[str, Any]  # key -> value, the skipped arrays left out
    lengths: dict[str, int]  # skipped array's key -> its number of entries
    tensors: list[Tensor]
    data_offset: int
    data: np.memmap  # the whole file


class _Cursor:
    def __init__(self, buffer: memoryview):
        self.buffer, self.at = buffer, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def scalar(self, value_type: int):
        return self.unpack(SCALARS[value_type])[0]

    def string(self) -> str:
        length = self.scalar(10)
        end = self.at + length
        if end > len(self.buffer):
            raise struct.error("string past the end")
        text = str(self.buffer[self.at : end], encoding="utf-8")
        self.at = end
        return text

    def value(self, value_type: int):
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            item_type, count = self.scalar(4), self.scalar(10)
            if item_type in SCALARS:  # one unpack for the whole array
                return list(self.unpack(f"{count}{SCALARS[item_type]}"))
            return [self.value(item_type) for _ in range(count)]
        if value_type not in SCALARS:
            raise ValueError(f"unknown GGUF value type {value_type}")
        return self.scalar(value_type)

    def skip_array(self) -> int:
        """Steps over an array value; returns its length."""
        item_type, count = self.scalar(4), self.scalar(10)
        if item_type in SCALARS:
            self.at += count * struct.calcsize(SCALARS[item_type])
        elif item_type == STRING:
            for _ in range(count):
                self.at += 8 + struct.unpack_from("<Q", self.buffer, self.at)[0]
        else:
            for _ in range(count):
                self.value(item_type)
        if self.at > len(self.buffer):
            raise struct.error("array past the end")
        return count


def read_header(path: str, skipped: tuple[str, ...] = ()) -> Header:
    """The header of the GGUF file at `path` (versions 2 and 3, little-endian, as llama.cpp writes them);
    the array fields named in `skipped` keep only their lengths. A file that is not one fails with
    ValueError naming it."""
    data = np.memmap(path, mode="r")
    try:
        return _parse(data, skipped)
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: truncated or corrupt header ({exc})") from exc
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _parse(data: np.memmap, skipped: tuple[str, ...]) -> Header:
    cursor = _Cursor(data.data)  # the mapping as a memoryview: struct reads it in place
    if bytes(cursor.buffer[:4]) != MAGIC:
        raise ValueError("not a GGUF file (no GGUF magic)")
    cursor.at = 4
    version = cursor.scalar(4)
    if version not in VERSIONS:
        byte_order = " (a big-endian file)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"GGUF version {version}{byte_order} is not supported; versions {VERSIONS} are")
    tensor_count, kv_count = cursor.scalar(10), cursor.scalar(10)
    fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key, value_type = cursor.string(), cursor.scalar(4)
        if key in skipped and value_type == ARRAY:
            lengths[key] = cursor.skip_array()
        else:
            fields[key] = cursor.value(value_type)
    index = [_tensor_info(cursor) for _ in range(tensor_count)]
    if len({info[0] for info in index}) < len(index):
        raise ValueError("two tensors share a name")
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_offset = -(-cursor.at // alignment) * alignment
    tensors = [_tensor(data, data_offset, *info) for info in index]
    return Header(fields, lengths, tensors, data_offset, data)


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    dims = cursor.scalar(4)
    shape = tuple(cursor.scalar(10) for _ in range(dims))
    return name, shape, cursor.scalar(4), cursor.scalar(10)


def _tensor(data: np.memmap, data_offset: int, name: str, shape: tuple[int, ...], type_number: int, offset: int):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    try:
        kind = GGMLQuantizationType(type_number)
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown ggml type {type_number}") from None
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    n_bytes = int(np.prod(shape, dtype=np.int64)) * block_bytes // block_values
    start = data_offset + offset
    if start + n_bytes > len(data):
        raise ValueError(f"tensor {name!r} ends past the end of the file")
    numpy_shape = tuple(reversed(shape))
    dtype = ARRAY_DTYPES.get(kind.name)
    if dtype is None:
        dtype, numpy_shape = np.uint8, quant_shape_to_byte_shape(numpy_shape, kind)
    view = data[start : start + n_bytes].view(dtype).reshape(numpy_shape)
    return Tensor(name, kind, shape, n_bytes, start, view)
