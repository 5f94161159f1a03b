"""The GGUF header walk: it reads what the gguf package's own reader reads, from the
header bytes only, on disk and over HTTPS range requests (a real server on loopback)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from planner.spec.ggufhead import FIRST_READ, ArrayLength, SourceError, read_local, read_remote
from tests.support.sparse_gguf import write_sparse_gguf
from tests.support.tiny_gguf import write_tiny_gguf
from tests.support.tls import make_ca, serve_https


def scalars(reader: gguf.GGUFReader) -> dict:
    found = {}
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and f.types and f.types[0] != gguf.GGUFValueType.ARRAY:
            found[name] = f.contents()
    return found


def test_reads_what_the_gguf_reader_reads(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    header, reference = read_local(path), gguf.GGUFReader(path)

    assert {k: v for k, v in header.metadata.items() if k in scalars(reference)} == pytest.approx(
        scalars(reference)
    )
    assert (
        header.metadata["tokenizer.ggml.tokens"]
        == reference.fields["tokenizer.ggml.tokens"].contents()
    )
    assert header.tensor_count == len(reference.tensors)
    assert header.tensor_bytes == sum(t.n_bytes for t in reference.tensors)
    assert header.data_offset == reference.data_offset
    assert header.file_size == path.stat().st_size
    assert header.architecture == "llama" and header.split is None


def test_a_header_longer_than_the_first_read_is_read_in_steps(tmp_path: Path) -> None:
    size = write_sparse_gguf(tmp_path / "big.gguf", layers=2)
    assert size > FIRST_READ
    header = read_local(tmp_path / "big.gguf")
    assert header.data_offset == size
    assert header.metadata["tokenizer.ggml.tokens"] == ArrayLength(32000)
    assert header.arch_key(gguf.Keys.LLM.BLOCK_COUNT) == 2


def test_not_gguf_and_cut_short_are_source_errors(tmp_path: Path) -> None:
    (tmp_path / "zeros.gguf").write_bytes(b"\0" * 1000)
    with pytest.raises(SourceError, match=r"zeros\.gguf is not a GGUF file"):
        read_local(tmp_path / "zeros.gguf")
    full = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(full[:3000])
    with pytest.raises(SourceError, match=r"cut\.gguf ends inside its GGUF header"):
        read_local(tmp_path / "cut.gguf")
    with pytest.raises(FileNotFoundError):
        read_local(tmp_path / "absent.gguf")


def test_over_https_only_header_bytes_are_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = make_ca(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.bundle))  # what Nomad's downloader trusts
    site = tmp_path / "site"
    site.mkdir()
    size = write_sparse_gguf(site / "big.gguf", layers=2)
    server = serve_https(site, ca)
    try:
        header = read_remote(f"{server.url}/big.gguf")
        assert header.data_offset == size
        assert header.file_size == (site / "big.gguf").stat().st_size
        assert server.requests == []  # nothing asked for whole
        assert [r[1] for r in server.ranges] == [0, FIRST_READ, 4 * FIRST_READ]
        assert max(last for _, _, last in server.ranges) < 4 * size

        with pytest.raises(SourceError, match=r"absent.gguf: HTTP 404"):
            read_remote(f"{server.url}/absent.gguf")
    finally:
        server.close()
    with pytest.raises(SourceError, match="is unreachable"):
        read_remote(f"{server.url}/big.gguf")
