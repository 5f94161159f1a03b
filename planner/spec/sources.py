"""The files a model source stands for: one GGUF file, or every shard of a split one.

Called by `planner.spec.definitions` (to check a split source's name and its sha256
list), `planner.spec.jobspec` (one Nomad artifact per shard) and `planner.spec.fit` (every
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

Nomad interpolates `${...}` (node attributes, metadata) in an artifact's source and
destination and in task args, and the planner derives a split source's shard names
from its URL percent-decoded: so a downloaded split's file name must be a plain name
(`PLAIN_NAME`) and a node path is used as written (`node_path_problem`), and no text a
definition puts in the job holds `${` after any decoding the planner does.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote, unquote, urlparse, urlunparse

from planner.spec.ggufhead import GgufHeader, read_local, read_remote

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# Where a single downloaded file goes in the allocation (local/model/<file>): the name
# every https:// model has had, so their rendered jobs stay as they were.
SINGLE_FILE = "model.gguf"
# Where file:// sources must lie on the nodes unless LLMGW_MODELS_ROOT says otherwise: the
# node layout of planner.spec.settings (engines in /opt/llmgw/bin, models in /opt/llmgw/models).
DEFAULT_MODELS_ROOT = "/opt/llmgw/models"
# A file name the job carries (a downloaded shard's, under local/model/): letters, digits,
# '.', '_', '+', '-', first a letter or digit, so never '.' or '..', a '/', a '%' or the
# '$' and '{' of Nomad's `${...}` (the same set as an engine artifact's file name).
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


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
    """The file name at the end of a node path (as written: the node decodes nothing) or
    of a download URL (its last path segment, percent-decoded as the server reads it; ''
    after a trailing '/'). A decoded name may hold anything, '/' and '${' included: a
    split's must pass `plain_name_problem` before its shards are named after it."""
    if local_path is not None:
        return PurePosixPath(local_path).name
    return unquote(urlparse(download_url or "").path.rsplit("/", 1)[-1])


def plain_name_problem(name: str) -> str | None:
    """Why `name` may not be a file name in the job (`PLAIN_NAME`), or None when it may."""
    if PLAIN_NAME.fullmatch(name):
        return None
    return (
        f"the file name {name!r} (percent-decoded) is not a plain file name (letters, "
        "digits, '.', '_', '+', '-'; first a letter or digit)"
    )


def node_path_problem(path: str) -> str | None:
    """Why node path `path` (a file:// source's, as written) may not be handed to the model
    task, or None when it may. The node opens the text byte for byte: it decodes no
    '%' (`%2e%2e` names a file of that name) and a '\\' is an ordinary character of a
    POSIX name, so either reads as a path the node never opens and the model parks on a
    file not found; a '..' resolves after any symlink before it, and '.' and '..' are
    refused alike so that every source names its file by one plain path."""
    if "%" in path:
        return (
            f"{path} has a '%': the node opens the path as written and decodes nothing; "
            "write the path without percent-encoding"
        )
    if "\\" in path:
        return f"{path} has a '\\': node paths are separated by '/' only"
    for segment in path.split("/"):
        if segment in (".", ".."):
            return f"{path} has a {segment!r} segment; name the file by its plain path"
    return None


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


def expand(
    local_path: str | None, download_url: str | None, sha256: str | tuple[str, ...] | None
) -> list[Shard]:
    """Every file of a source, the one llama-server is given first. A split source's
    shards keep their names; a single download is saved as SINGLE_FILE."""
    split = split_of(source_name(local_path, download_url))
    if split is None:
        single = sha256 if isinstance(sha256, str) else None
        return [
            Shard(
                local_path,
                download_url,
                PurePosixPath(local_path).name if local_path else SINGLE_FILE,
                single,
            )
        ]
    sums = sha256 if isinstance(sha256, tuple) else (None,) * split.count
    found = []
    for number, digest in zip(range(1, split.count + 1), sums, strict=True):
        name = split.name(number)
        if local_path is not None:
            found.append(Shard(str(PurePosixPath(local_path).with_name(name)), None, name, digest))
        else:
            found.append(Shard(None, _beside(download_url or "", name), name, digest))
    return found


def interpolated(shards: list[Shard]) -> str | None:
    """The first text of `shards` the job would carry (node path, URL, file name) that
    holds Nomad's `${`, or None. `plain_name_problem` and the checks of the source's own
    text keep this None; it stands guard over what is derived from them."""
    for shard in shards:
        for text in (shard.local_path, shard.url, shard.file):
            if text is not None and "${" in text:
                return text
    return None


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


def models_roots(root: str) -> list[str]:
    """The folders of a models root setting: one path, or several joined by ':' as in
    PATH (``/opt/llmgw/models:/mnt/models``)."""
    return [part for part in root.split(":") if part]


def outside_root(path: str, root: str) -> str | None:
    """Why node path `path` (absolute) may not be a model source under models root `root`
    (absolute; several joined by ':', see models_roots: any of them will do), or None
    when it may.

    A `..` segment is refused outright: the node's kernel resolves it after any symlink
    before it, which no reading of the text can know. The text must then lie under the
    root, and so must its real path on this machine, against the root's own real path:
    every link among the components this machine has is resolved (os.path.realpath,
    which keeps a missing tail as written), so a link under the root to a key elsewhere
    is refused, and so is a link to a folder elsewhere when the file itself is missing
    here (root/etc-link/key). Components this machine lacks are judged on their text."""
    if ".." in path.split("/"):
        return f"{path} has a '..' segment; name the file by its path under {root}"
    roots = models_roots(root)
    lexical = posixpath.normpath(path)
    # Judged by the roots its text lies under; a link problem under one of them is
    # the answer only if no other root admits it.
    problems = [
        _through_a_link(path, one) for one in roots if _under(lexical, posixpath.normpath(one))
    ]
    if None in problems:
        return None
    if problems:
        return problems[0]
    return f"{path} is outside the models root{'s' if len(roots) > 1 else ''} {root}"


def _through_a_link(path: str, root: str) -> str | None:
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if not _under(real, real_root):
        return (
            f"{path} leads through a link on this machine to {real}, outside the models root {root}"
        )
    return None
