"""The files a model source stands for: one GGUF file, or every shard of a split one.

Called by `planner.definitions` (to check a split source's name and its sha256
list), `planner.jobspec` (one Nomad artifact per shard) and `planner.fit` (every
shard's header is read, which proves it reachable, before anything is registered).

A split model is the files llama.cpp's gguf-split writes,
`<prefix>-00001-of-00003.gguf` ... `<prefix>-00003-of-00003.gguf` (llama.cpp
`llama_split_path`: "%s-%05d-of-%05d.gguf"), each with `split.no`, `split.count`
and `split.tensors.count` in its header. llama-server is given the first and
opens the others beside it by those names ("invalid split file name" otherwise),
so every shard is downloaded under its own name into one folder.

A `file://` source is a path on the nodes, opened there by the model task (as the
Nomad agent's user under raw_exec, root by default), so it must lie under the
models root (`LLMGW_MODELS_ROOT`, default /opt/llmgw/models; `outside_root`): the
model file may name the node's weights, never its keys or its configuration.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote, unquote, urlparse, urlunparse

from planner.ggufhead import GgufHeader, read_local, read_remote

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# Where a single downloaded file goes in the allocation (local/model/<file>): the name
# every https:// model has had, so their rendered jobs stay as they were.
SINGLE_FILE = "model.gguf"
# Where file:// sources must lie on the nodes unless LLMGW_MODELS_ROOT says otherwise: the
# node layout of planner.settings (engines in /opt/llmgw/bin, models in /opt/llmgw/models).
DEFAULT_MODELS_ROOT = "/opt/llmgw/models"


@dataclass(frozen=True)
class Split:
    """A split file name: its prefix, which shard (from 1) and of how many."""

    prefix: str
    number: int
    count: int

    def name(self, number: int) -> str:
        return f"{self.prefix}-{number:05d}-of-{self.count:05d}.gguf"


def split_of(name: str) -> Split | None:
    """The split a file name says it belongs to, or None for a single file."""
    match = SPLIT_NAME.match(name)
    if match is None or int(match["count"]) < 2:
        return None
    return Split(match["prefix"], int(match["no"]), int(match["count"]))


def source_name(local_path: str | None, download_url: str | None) -> str:
    """The file name at the end of a node path or a download URL."""
    path = local_path if local_path is not None else unquote(urlparse(download_url or "").path)
    return PurePosixPath(path).name


@dataclass(frozen=True)
class Shard:
    """One file to fetch: a node path (file://) or a URL, the name it is downloaded under
    (local/model/<file>), and its sha256 when the definition gives one."""

    local_path: str | None
    url: str | None
    file: str
    sha256: str | None = None


def _beside(url: str, name: str) -> str:
    """`url` with its last path segment replaced by `name` (kept percent-encoded)."""
    parts = urlparse(url)
    return urlunparse(parts._replace(path=parts.path.rsplit("/", 1)[0] + "/" + quote(name)))


def expand(local_path: str | None, download_url: str | None,
           sha256: str | tuple[str, ...] | None) -> list[Shard]:
    """Every file of a source, the one llama-server is given first. A split source's
    shards keep their names; a single download is saved as SINGLE_FILE."""
    split = split_of(source_name(local_path, download_url))
    if split is None:
        single = sha256 if isinstance(sha256, str) else None
        return [Shard(local_path, download_url,
                      PurePosixPath(local_path).name if local_path else SINGLE_FILE, single)]
    sums = sha256 if isinstance(sha256, tuple) else (None,) * split.count
    found = []
    for number, digest in zip(range(1, split.count + 1), sums, strict=True):
        name = split.name(number)
        if local_path is not None:
            found.append(Shard(str(PurePosixPath(local_path).with_name(name)), None, name,
                               digest))
        else:
            found.append(Shard(None, _beside(download_url or "", name), name, digest))
    return found


def read_shard(shard: Shard) -> GgufHeader:
    """The shard's GGUF header: read here for a node path (FileNotFoundError when this
    machine lacks it), by range requests for a URL. Raises ggufhead.SourceError."""
    if shard.local_path is not None:
        return read_local(Path(shard.local_path))
    return read_remote(shard.url or "")


def _under(path: str, root: str) -> bool:
    """Whether normalised absolute `path` is `root` itself or inside it, by whole segments
    (/opt/models-old is not under /opt/models)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def outside_root(path: str, root: str) -> str | None:
    """Why node path `path` (absolute) may not be a model source under models root `root`
    (absolute), or None when it may.

    A `..` segment is refused outright: the node's kernel resolves it after any symlink
    before it, which no reading of the text can know. The text must then lie under the
    root; and where this machine has the path, so must its real path (symlinks
    resolved against the root's own real path): a link under the root to a key elsewhere
    is refused here. A path this machine lacks is judged on its text alone."""
    if ".." in path.split("/"):
        return f"{path} has a '..' segment; name the file by its path under {root}"
    lexical = posixpath.normpath(path)
    if not _under(lexical, posixpath.normpath(root)):
        return f"{path} is outside the models root {root}"
    if os.path.lexists(path):
        real, real_root = os.path.realpath(path), os.path.realpath(root)
        if not _under(real, real_root):
            return (f"{path} is a link on this machine to {real}, outside the models root "
                    f"{root}")
    return None
