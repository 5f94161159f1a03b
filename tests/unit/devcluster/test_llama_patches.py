"""devcluster.llama_patches: llama.cpp's source is patched exactly, or not at all."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from devcluster import bootstrap, llama_patches
from devcluster.llama_patches import PATCHES, PatchError


def tree(root: Path, text: str) -> Path:
    (root / "tools/server").mkdir(parents=True)
    (root / "tools/server/server-queue.cpp").write_text(text)
    return root / "tools/server/server-queue.cpp"


UPSTREAM = (
    "#include <chrono>\n"
    + llama_patches.RECV_DEADLINE.old
    + "        std::unique_lock<std::mutex> lock(mutex_results);\n"
    + "        std::cv_status cr_res = "
    + llama_patches.RECV_WAIT_UNTIL.old
    + "\n    }\n}\n"
)


def test_the_wait_keeps_one_deadline(tmp_path: Path) -> None:
    path = tree(tmp_path, UPSTREAM)
    lines = llama_patches.apply(tmp_path)
    text = path.read_text()
    assert "wait_for(" not in text
    assert "condition_results.wait_until(lock, deadline);" in text
    # the deadline is set once, before the loop that waits
    assert text.index("const auto deadline") < text.index("while (true)")
    assert len(lines) == len(PATCHES)


@pytest.mark.parametrize("copies", [0, 2])
def test_text_not_there_exactly_once_fails_and_writes_nothing(tmp_path: Path, copies: int) -> None:
    text = UPSTREAM.replace(llama_patches.RECV_WAIT_UNTIL.old, "")
    text += llama_patches.RECV_WAIT_UNTIL.old * copies
    path = tree(tmp_path, text)
    with pytest.raises(PatchError, match=rf"server-queue.cpp: .* found it {copies} times"):
        llama_patches.apply(tmp_path)
    assert path.read_text() == text


def test_a_changed_patch_is_a_new_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    before = bootstrap.llama_build_key("x86_64")
    changed = (llama_patches.RECV_DEADLINE,)
    monkeypatch.setattr(llama_patches, "PATCHES", changed)
    assert bootstrap.llama_build_key("x86_64") != before


def test_the_cached_sdist_takes_every_patch(tmp_path: Path) -> None:
    """The pinned sdist's own source (when the bootstrap has downloaded it)."""
    sdist = bootstrap.CACHE / "downloads" / bootstrap.LLAMA_SDIST
    if not sdist.exists():
        pytest.skip(f"no {sdist} (run the bootstrap)")
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(PATCHES[0].path))
        tar.extractall(tmp_path, members=[member], filter="data")
    source = Path(str(next(tmp_path.rglob("server-queue.cpp"))).removesuffix(PATCHES[0].path))
    assert len(llama_patches.apply(source)) == len(PATCHES)
