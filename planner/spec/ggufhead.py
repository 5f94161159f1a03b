"""Read a GGUF file's header (metadata and tensor table) without its weights.

Called by `planner.spec.fit` at `planner apply`, before anything is registered or
downloaded. A file:// source is read on this machine; an https:// one (hf://
resolves to one) with HTTP range requests for the header bytes only: 64 KiB
first, then four times as much while the header goes on, so a model of any
size costs a few requests of a few MiB (Gemma 3's 262k-token vocabulary puts
its header at 6.2 MiB).

The layout is GGUF v2/v3's (ggml docs/gguf.md): magic, version, tensor count,
metadata count, the metadata key/value pairs, the tensor infos (name, dims,
ggml type, offset), then the data from an aligned offset. Value and tensor
types, block sizes and the `split.*` keys come from the `gguf` package (the
llama.cpp project's). The walk itself is here and not `gguf.GGUFReader`: that
reader needs the whole file mapped and builds every array element with numpy,
15 to 30 s for Gemma 3's header on the dev machine, where this takes well under
a second; `tests/unit/planner/test_ggufhead.py` checks both read the same.
"""

from __future__ import annotations

import ssl
import struct
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    Keys,
)

FIRST_READ = 64 * 2**10
MAX_HEADER = 1 * 2**30  # no real header comes near; a larger one is refused
TIMEOUT_S = 30
# Arrays longer than this keep only their length (the vocabulary, merges, scores):
# per-layer arrays (head counts of some architectures) stay whole.
KEEP_ARRAY = 4096

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class SourceError(Exception):
    """The source could not be read (unreachable, refused, not found), or is not a GGUF
    file; the message says which and where."""


class _NeedMore(Exception):
    """Not an error: the header goes on past the bytes read; `needed` is how far."""

    def __init__(self, needed: int) -> None:
        self.needed = needed


@dataclass(frozen=True)
class ArrayLength:
    """A metadata array kept as its length only (see KEEP_ARRAY)."""

    length: int


@dataclass(frozen=True)
class GgufHeader:
    """What one GGUF file says about itself.

    `metadata`: key -> int/float/bool/str, a list for short arrays, ArrayLength for
    long ones. `tensor_bytes`: the tensors' data in this file (bytes, by ggml type and
    shape; tensors of `unknown_types` not counted). `data_offset`: where the tensor
    data starts (the header's size, bytes). `file_size`: bytes, None when the server
    did not say.
    """

    where: str
    metadata: dict[str, Any] = field(repr=False)
    tensor_count: int
    tensor_bytes: int
    data_offset: int
    file_size: int | None
    unknown_types: frozenset[int] = frozenset()  # ggml types the gguf package lacks

    @property
    def architecture(self) -> str:
        return str(self.metadata.get(Keys.General.ARCHITECTURE, ""))

    def arch_key(self, template: str) -> Any:
        """A `{arch}.` key's value (e.g. Keys.LLM.BLOCK_COUNT), or None."""
        return self.metadata.get(template.format(arch=self.architecture))

    @property
    def split(self) -> tuple[int, int] | None:
        """(split.no counted from 0, split.count) for a shard of a split model, else None."""
        count = self.metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT)
        if not isinstance(count, int) or count <= 1:
            return None
        return int(self.metadata.get(Keys.Split.LLM_KV_SPLIT_NO, 0)), count


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise _NeedMore(end)
        chunk = self.buf[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        try:
            return self.unpack(_SCALARS[GGUFValueType(kind)])
        except (ValueError, KeyError):
            raise SourceError(f"unknown GGUF value type {kind}") from None

    def array(self) -> list[Any] | ArrayLength:
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if count <= KEEP_ARRAY:
            return [self.value(kind) for _ in range(count)]
        if kind in _SCALARS:
            self.take(count * struct.calcsize(_SCALARS[GGUFValueType(kind)]))
        else:
            for _ in range(count):
                self.value(kind)
        return ArrayLength(count)


def _tensor_bytes(cursor: _Cursor, unknown: set[int]) -> int:
    """One tensor info's data size in bytes; a ggml type newer than the gguf package
    counts 0 and goes into `unknown`."""
    cursor.string()  # name
    dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
    kind = cursor.unpack("<I")
    cursor.unpack("<Q")  # offset in the data section
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        unknown.add(kind)
        return 0
    elements = 1
    for dim in dims:
        elements *= dim
    return elements * size // block


def parse(buf: bytes, where: str, file_size: int | None) -> GgufHeader:
    """Parse the header at the start of `buf`. Raises SourceError when it is not GGUF,
    _NeedMore(n) when the header goes on past `buf` (n: bytes needed at least)."""
    cursor = _Cursor(buf)
    if cursor.unpack("<I") != GGUF_MAGIC:
        raise SourceError(f"{where} is not a GGUF file (no GGUF magic in its first bytes)")
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise SourceError(
            f"{where}: GGUF version {version} is not supported (2 or 3; "
            "a big-endian file reads as a huge version)"
        )
    tensors, pairs = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(pairs):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    unknown: set[int] = set()
    tensor_bytes = sum(_tensor_bytes(cursor, unknown) for _ in range(tensors))
    alignment = metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    data_offset = -(-cursor.pos // alignment) * alignment
    return GgufHeader(
        where, metadata, tensors, tensor_bytes, data_offset, file_size, frozenset(unknown)
    )


def _read_growing(
    first: bytes, read: Callable[[int, int], bytes], where: str, file_size: int | None
) -> GgufHeader:
    """Parse from `first` (the file's first FIRST_READ bytes, fewer if it is shorter) and
    `read(start, end)` (bytes [start, end), fewer at the file's end), reading 4x more
    each time the header goes on."""
    buf, ended = first, len(first) < FIRST_READ
    while True:
        try:
            return parse(buf, where, file_size)
        except _NeedMore as more:
            if ended:
                raise SourceError(f"{where} ends inside its GGUF header") from None
            if more.needed > MAX_HEADER:
                raise SourceError(f"{where}: GGUF header larger than {MAX_HEADER} bytes") from None
            end = max(more.needed, 4 * len(buf))
            chunk = read(len(buf), end)
            buf, ended = buf + chunk, len(buf) + len(chunk) < end


def read_local(path: Path) -> GgufHeader:
    """The header of a file on this machine. Raises FileNotFoundError when it is not
    here (a node path this machine lacks), SourceError when unreadable or not GGUF."""
    try:
        with path.open("rb") as f:
            size = path.stat().st_size

            def read(start: int, end: int) -> bytes:
                f.seek(start)
                return f.read(end - start)

            return _read_growing(read(0, FIRST_READ), read, str(path), size)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror}") from None


def read_remote(url: str, opener: Callable[..., Any] = urllib.request.urlopen) -> GgufHeader:
    """The header of a file on an HTTPS server, by range requests (redirects followed, as
    the Hub's resolve/ URLs need). TLS trusts the system's CAs or SSL_CERT_FILE, as
    Nomad's downloader on the nodes does. A server that ignores Range answers 200: only
    the bytes needed are read, then the connection is closed. Raises SourceError."""
    context = ssl.create_default_context()
    sizes: list[int | None] = [None]

    def read(start: int, end: int) -> bytes:
        request = urllib.request.Request(
            url, headers={"Range": f"bytes={start}-{end - 1}", "User-Agent": "llmgw-planner"}
        )
        try:
            with opener(request, timeout=TIMEOUT_S, context=context) as response:
                if response.status == 206:
                    total = response.headers.get("Content-Range", "").rpartition("/")[2]
                    sizes[0] = int(total) if total.isdigit() else None
                    return response.read(end - start)
                length = response.headers.get("Content-Length")
                sizes[0] = int(length) if length and length.isdigit() else None
                response.read(start)  # no range support: skip what we have
                return response.read(end - start)
        except urllib.error.HTTPError as exc:
            raise SourceError(f"{url}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise SourceError(f"{url} is unreachable ({reason})") from None

    first = read(0, FIRST_READ)
    return _read_growing(first, read, url, sizes[0])
