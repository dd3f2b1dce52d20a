"""A GGUF file's structure, checked before gguf or transformers parse it.

Their readers trust the file's own counts, lengths and offsets (the class of the
out-of-bounds bugs found in llama.cpp's and Ollama's loaders): a lying length ends in
an unpack error deep inside them, a lying tensor offset in a model that loads with
garbage weights, and a lying layer count in a model built far larger than the file.
Here every count, length, offset and size is checked against the bytes really there,
as llama.cpp's own loader does, so such a file ends in one ModelLoadError.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruvllm_cli.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
HEADER_BYTES = 24  # magic, version, tensor count, key/value count
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, UINT32 = 8, 9, 4
# The fixed-size value types: (struct format, bytes).
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
           6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
MIN_ENTRY_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dimension count, one dimension, type, offset
# Metadata that sizes the model: a lie there builds a model far larger than the file.
POSITIVE_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv")
HINT = "the file is damaged or truncated: download it again"


class GGUFError(Exception):
    """What is wrong with the file, in a few words."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: the row length first
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFLayout:
    """What check_gguf read: scalar and string metadata, the tensor table, the data start."""

    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_start: int


def check_gguf(path: Path) -> GGUFLayout:
    """Read and check `path`'s header, metadata and tensor table against its size;
    ModelLoadError with what is wrong when anything does not fit."""
    try:
        with path.open("rb") as handle:
            size = path.stat().st_size
            if size < HEADER_BYTES:
                raise GGUFError(f"it is {size} bytes, shorter than a GGUF header")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return read_layout(Reader(data, size))
    except GGUFError as error:
        raise ModelLoadError(f"{path} is not a valid GGUF file: {error}", HINT) from None
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror or error}") from None


class Reader:
    """A cursor over the file's bytes that never reads past its end."""

    def __init__(self, data: Any, size: int) -> None:
        self.data, self.size, self.pos = data, size, 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def take(self, count: int, what: str) -> int:
        """Skip `count` bytes; returns where they start."""
        if count > self.left:
            raise GGUFError(f"{what} at byte {self.pos} needs {count} bytes, {self.left} are left")
        start, self.pos = self.pos, self.pos + count
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.unpack("<Q", what)
        start = self.take(length, what)
        try:
            return bytes(self.data[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} at byte {start} is not UTF-8") from None


def read_layout(reader: Reader) -> GGUFLayout:
    tensor_count, entry_count = read_header(reader)
    metadata = read_metadata(reader, entry_count)
    alignment = metadata_alignment(metadata)
    tensors = read_tensor_table(reader, tensor_count, alignment)
    data_start = -(-reader.pos // alignment) * alignment
    if data_start > reader.size:
        raise GGUFError(f"its data section would start at byte {data_start}, past its end")
    for tensor in tensors:
        check_tensor_data(tensor, reader.size - data_start)
    check_model_size(metadata, tensors)
    return GGUFLayout(metadata, tensors, data_start)


def read_header(reader: Reader) -> tuple[int, int]:
    if bytes(reader.data[:4]) != MAGIC:
        raise GGUFError(f"it starts with {bytes(reader.data[:4])!r}, not the GGUF magic {MAGIC!r}")
    reader.take(4, "magic")
    version = reader.unpack("<I", "version")
    if version not in VERSIONS:
        raise GGUFError(f"it is version {version}; ruvllm reads little-endian GGUF versions 2 and 3")
    tensor_count, entry_count = reader.unpack("<Q", "tensor count"), reader.unpack("<Q", "key/value count")
    if entry_count > reader.left // MIN_ENTRY_BYTES:
        raise GGUFError(f"it says it holds {entry_count} metadata entries, more than its size allows")
    if tensor_count > reader.left // MIN_TENSOR_INFO_BYTES:
        raise GGUFError(f"it says it holds {tensor_count} tensors, more than its size allows")
    return tensor_count, entry_count


def read_metadata(reader: Reader, count: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(count):
        key = reader.string("a metadata key")
        if key in metadata:
            raise GGUFError(f"the metadata key {key!r} appears twice")
        value_type = reader.unpack("<I", f"the type of {key}")
        if key == "general.alignment" and value_type != UINT32:
            raise GGUFError(f"general.alignment has the value type {value_type}, not uint32")
        metadata[key] = read_value(reader, value_type, key)
    return metadata


def read_value(reader: Reader, value_type: int, key: str) -> Any:
    """A scalar or a string; for an array, a (item type, count) pair after checking it."""
    if value_type in SCALARS:
        return reader.unpack(SCALARS[value_type][0], key)
    if value_type == STRING:
        return reader.string(key)
    if value_type != ARRAY:
        raise GGUFError(f"{key} has the unknown value type {value_type}")
    item_type, count = reader.unpack("<I", key), reader.unpack("<Q", key)
    if item_type in SCALARS:
        reader.take(count * SCALARS[item_type][1], key)
    elif item_type == STRING:
        if count > reader.left // 8:
            raise GGUFError(f"{key} says it holds {count} strings, more than the file has room for")
        for _ in range(count):   # a vocabulary: only the lengths matter here
            reader.take(reader.unpack("<Q", key), key)
    else:
        raise GGUFError(f"{key} is an array of the unsupported type {item_type}")
    return (item_type, count)


def metadata_alignment(metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment is {alignment!r}, not a power of two")
    return alignment


def read_tensor_table(reader: Reader, count: int, alignment: int) -> tuple[TensorInfo, ...]:
    tensors: dict[str, TensorInfo] = {}
    for _ in range(count):
        tensor = read_tensor_info(reader)
        if tensor.name in tensors:
            raise GGUFError(f"the tensor {tensor.name} appears twice")
        if tensor.offset % alignment:
            raise GGUFError(f"the tensor {tensor.name} starts at {tensor.offset}, not a multiple of {alignment}")
        tensors[tensor.name] = tensor
    return tuple(tensors.values())


def read_tensor_info(reader: Reader) -> TensorInfo:
    name = reader.string("a tensor name")
    n_dims = reader.unpack("<I", f"the dimension count of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"the tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} are possible)")
    dims = tuple(reader.unpack("<Q", f"the shape of {name}") for _ in range(n_dims))
    ggml_type = reader.unpack("<I", f"the type of {name}")
    return TensorInfo(name, dims, ggml_type, reader.unpack("<Q", f"the offset of {name}"))


def tensor_bytes(tensor: TensorInfo) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    if tensor.ggml_type not in GGML_QUANT_SIZES:
        raise GGUFError(f"the tensor {tensor.name} has the unknown type {tensor.ggml_type}")
    block, block_bytes = GGML_QUANT_SIZES[tensor.ggml_type]
    if tensor.dims[0] % block:
        raise GGUFError(f"the rows of {tensor.name} ({tensor.dims[0]}) are no whole number of {block}-blocks")
    elements = 1
    for dim in tensor.dims:
        elements *= dim   # Python integers: no overflow to hide a huge shape
    return elements // block * block_bytes


def check_tensor_data(tensor: TensorInfo, data_bytes: int) -> None:
    size = tensor_bytes(tensor)
    if tensor.offset + size > data_bytes:
        raise GGUFError(f"the tensor {tensor.name} ({size} bytes at {tensor.offset}) runs past the end "
                        f"of the {data_bytes}-byte data section")


def check_model_size(metadata: dict[str, Any], tensors: tuple[TensorInfo, ...]) -> None:
    """The metadata that sizes the model must be positive, and no more layers than the
    file holds tensors for."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("it names no general.architecture")
    for name in POSITIVE_KEYS:
        value = metadata.get(f"{arch}.{name}")
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise GGUFError(f"{arch}.{name} is {value}")
    layers = {t.name.split(".")[1] for t in tensors if t.name.startswith("blk.") and t.name.count(".") >= 2}
    declared = metadata.get(f"{arch}.block_count")
    if isinstance(declared, int) and declared != len(layers):   # fewer had loaded a shorter model, silently
        raise GGUFError(f"{arch}.block_count says {declared} layers; it holds tensors for {len(layers)}")
    count = metadata.get("tokenizer.ggml.tokens")   # (item type, count), as arrays are kept here
    tokens = count[1] if isinstance(count, tuple) and len(count) == 2 and isinstance(count[1], int) else None
    for role in ("bos", "eos", "padding", "unknown"):
        token = metadata.get(f"tokenizer.ggml.{role}_token_id")
        if tokens is not None and isinstance(token, int) and not 0 <= token < tokens:
            raise GGUFError(f"tokenizer.ggml.{role}_token_id is {token}, beyond its {tokens} tokens")
