"""Damaged and lying variants of a valid GGUF file, for the loader's fuzz test.

`mutations(data)` maps a name to the mutated bytes: truncations at every structural
boundary, lying counts and lengths, impossible tensor shapes, types and offsets, bad
alignment, magic and version, duplicate names, and metadata that would make the
model huge. The layout is read from the valid file with gguf's own reader.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

U32, U64 = "<I", "<Q"
STRING, ARRAY = 8, 9  # GGUFValueType


@dataclass(frozen=True)
class Entry:
    """One key/value pair: where its key length, value type and value start."""

    key: str
    offset: int
    type_at: int
    value_at: int
    types: tuple[int, ...]  # the value type, then the item type for arrays


@dataclass(frozen=True)
class TensorInfo:
    name: str
    offset: int  # of the name's length
    n_dims_at: int
    dims: tuple[int, ...]
    type_at: int
    data_offset_at: int
    data_offset: int  # relative to the data section
    n_bytes: int


@dataclass(frozen=True)
class Layout:
    size: int
    entries: dict[str, Entry]
    tensors: list[TensorInfo]
    data_start: int


def read_layout(path: Path) -> Layout:
    import gguf

    reader = gguf.GGUFReader(path)
    entries = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        type_at = field.offset + 8 + len(name.encode())
        entries[name] = Entry(name, field.offset, type_at, type_at + 4, tuple(int(t) for t in field.types))
    tensors = []
    for tensor in reader.tensors:
        n_dims_at = tensor.field.offset + 8 + len(tensor.name.encode())
        type_at = n_dims_at + 4 + 8 * len(tensor.shape)
        tensors.append(TensorInfo(tensor.name, tensor.field.offset, n_dims_at, tuple(int(d) for d in tensor.shape),
                                  type_at, type_at + 4, tensor.data_offset - reader.data_offset, tensor.n_bytes))
    return Layout(path.stat().st_size, entries, tensors, reader.data_offset)


def patch(data: bytes, at: int, fmt: str, value: int) -> bytes:
    packed = struct.pack(fmt, value)
    return data[:at] + packed + data[at + len(packed):]


def truncations(layout: Layout) -> Iterator[tuple[str, int]]:
    """Cut points: inside the fixed header, at and just inside every key/value pair and
    tensor info, around the start of the data, inside tensors, one byte short."""
    points = {0, 1, 3, 4, 7, 8, 15, 16, 23, 24}
    for entry in layout.entries.values():
        points |= {entry.offset, entry.offset + 5, entry.type_at + 2, entry.value_at, entry.value_at + 1}
        if entry.types[0] == ARRAY:
            points |= {entry.value_at + 4, entry.value_at + 12, entry.value_at + 13}
    for tensor in layout.tensors:
        points |= {tensor.offset, tensor.n_dims_at + 2, tensor.type_at, tensor.data_offset_at + 3}
    points |= {layout.data_start - 1, layout.data_start, layout.data_start + 1, layout.size - 1}
    for tensor in layout.tensors[::4]:
        points.add(layout.data_start + tensor.data_offset + tensor.n_bytes // 2)
    for point in sorted(points):
        if 0 <= point < layout.size:
            yield f"truncated at {point}", point


def header_mutations(data: bytes, layout: Layout) -> Iterator[tuple[str, bytes]]:
    for magic in (b"GGUG", b"GGML", b"\0\0\0\0", b"FUGG"):
        yield f"magic {magic!r}", magic + data[4:]
    for version in (0, 1, 4, 2**31, 0x03000000):
        yield f"version {version:#x}", patch(data, 4, U32, version)
    n_tensors, n_kv = len(layout.tensors), len(layout.entries)
    for count in (0, n_tensors - 1, n_tensors + 1, 2**32, 2**63, 2**64 - 1):
        yield f"tensor count {count}", patch(data, 8, U64, count)
    for count in (0, n_kv - 1, n_kv + 1, 2**32, 2**64 - 1):
        yield f"kv count {count}", patch(data, 16, U64, count)


def entry_mutations(data: bytes, layout: Layout) -> Iterator[tuple[str, bytes]]:
    arch, eos = layout.entries["general.architecture"], layout.entries["tokenizer.ggml.eos_token_id"]
    tokens, token_types = layout.entries["tokenizer.ggml.tokens"], layout.entries["tokenizer.ggml.token_type"]
    for length in (2**40, 2**63, 2**64 - 1):
        yield f"key length {length}", patch(data, arch.offset, U64, length)
        yield f"string length {length}", patch(data, arch.value_at, U64, length)
        yield f"token array length {length}", patch(data, tokens.value_at + 4, U64, length)
        yield f"int32 array length {length}", patch(data, token_types.value_at + 4, U64, length)
    template = layout.entries["tokenizer.chat_template"]
    yield "last string one byte too long", patch(data, template.value_at, U64, layout.size)
    for kind in (13, 99, 2**32 - 1, ARRAY):
        yield f"value type {kind}", patch(data, layout.entries["llama.block_count"].type_at, U32, kind)
        yield f"array item type {kind}", patch(data, tokens.value_at, U32, kind)
    yield "u32 read as a string", patch(data, layout.entries["llama.block_count"].type_at, U32, STRING)
    yield "duplicate key", data.replace(b"tokenizer.ggml.eos_token_id", b"tokenizer.ggml.bos_token_id")
    key_at = eos.offset + 8
    yield "key not UTF-8", data[:key_at] + b"\xff" + data[key_at + 1:]


def tensor_mutations(data: bytes, layout: Layout) -> Iterator[tuple[str, bytes]]:
    first, last = layout.tensors[0], layout.tensors[-1]   # token_embd.weight is Q8_0 [64, 512]
    for n_dims in (0, 5, 2**32 - 1):
        yield f"n_dims {n_dims}", patch(data, first.n_dims_at, U32, n_dims)
    dims_at = first.n_dims_at + 4
    yield "2**40 elements", patch(data, dims_at, U64, 2**40 // first.dims[1])
    yield "elements overflow 2**64", patch(patch(data, dims_at, U64, 2**32), dims_at + 8, U64, 2**32)
    yield "dimension 2**63", patch(data, dims_at + 8, U64, 2**63)
    yield "row not a whole block", patch(data, dims_at, U64, first.dims[0] - 1)
    for kind in (4, 99, 2**32 - 1):   # 4: a removed type
        yield f"tensor type {kind}", patch(data, first.type_at, U32, kind)
    yield "tensor type F32 (4x the bytes: past the end)", patch(data, first.type_at, U32, 0)
    data_size = layout.size - layout.data_start
    for offset, label in ((first.data_offset + 1, "misaligned"), (data_size, "at the end"),
                          (data_size - last.n_bytes // 2 // 32 * 32, "running past the end"),
                          (2**63, "2**63"), (2**64 - 32, "wrapping around")):
        yield f"tensor offset {label}", patch(data, last.data_offset_at, U64, offset)
    # blk.0.ffn_down.weight and blk.0.ffn_gate.weight: names of the same length
    down, gate = (next(t for t in layout.tensors if t.name == name) for name in ("blk.0.ffn_down.weight",
                                                                                 "blk.0.ffn_gate.weight"))
    yield "duplicate tensor name", data[:gate.offset + 8] + down.name.encode() + data[gate.n_dims_at:]


def metadata_mutations(data: bytes, layout: Layout) -> Iterator[tuple[str, bytes]]:
    """A well-formed file whose model would be huge or impossible."""
    for key, values in (("llama.block_count", (1000, 2**31)), ("llama.embedding_length", (0, 2**31)),
                        ("llama.feed_forward_length", (2**31,)), ("llama.attention.head_count", (0, 2**31)),
                        ("llama.attention.head_count_kv", (0, 2**31)), ("llama.vocab_size", (2**31,))):
        for value in values:
            yield f"{key} = {value}", patch(data, layout.entries[key].value_at, U32, value)


def alignment_mutations(data: bytes, layout: Layout) -> Iterator[tuple[str, bytes]]:
    """For a file written with `general.alignment`."""
    entry = layout.entries["general.alignment"]
    for value in (0, 3, 48, 2**31):
        yield f"alignment {value}", patch(data, entry.value_at, U32, value)
    yield "alignment as int32", patch(data, entry.type_at, U32, 5)


def mutations(path: Path, aligned_path: Path) -> dict[str, bytes]:
    """Every mutation of the valid file `path` (and of `aligned_path`, written with
    `general.alignment` 64), by name."""
    data, layout = path.read_bytes(), read_layout(path)
    found = {name: data[:cut] for name, cut in truncations(layout)}
    for source in (header_mutations, entry_mutations, tensor_mutations, metadata_mutations):
        found.update(source(data, layout))
    aligned = aligned_path.read_bytes()
    found.update(alignment_mutations(aligned, read_layout(aligned_path)))
    return found
