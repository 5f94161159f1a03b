"""C24: a split GGUF named by its first shard, over https, on real parts: every shard is
verified at apply, downloaded by Nomad under its own name, and the model serves; a
shard that cannot be fetched is refused at apply, before anything is registered."""

from __future__ import annotations

import hashlib
import json
import urllib.error
from collections.abc import Callable
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from tests.conftest import forget_models, http_json, nomad_get, wait_for
from tests.integration.test_fit import registered
from tests.support.tiny_gguf import write_tiny_gguf
from tests.support.tls import TlsCA, serve_https

pytestmark = pytest.mark.integration

SHARDS = [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
PROFILE = 'context: 512\n  cpu: 100\n  memory: 256MiB\n  args: ["--threads", "1"]'


def completion(router: str, model: str) -> dict | None:
    try:
        return http_json(
            f"{router}/v1/completions", {"model": model, "prompt": "a", "max_tokens": 4}
        )
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            return None
        raise


def test_c24_split_gguf_over_https_is_fetched_shard_by_shard_and_serves(
    cluster: Cluster,
    planner: Callable,
    router: str,
    test_ca: TlsCA,
    model_files: Callable[..., Path],
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    first = write_tiny_gguf(site / "tiny.gguf", split_max_tensors=8)
    assert sorted(p.name for p in site.iterdir()) == SHARDS
    sums = [hashlib.sha256((site / name).read_bytes()).hexdigest() for name in SHARDS]
    server = serve_https(site, test_ca)
    try:
        folder = model_files(
            "c24-split",
            source=f"{server.url}/{first.name}",
            profile=PROFILE,
            extra=f"sha256: {json.dumps(sums)}\n",
        )
        result = planner("apply", str(folder), "--wait", "--timeout", "120")
        assert result.returncode == 0, result.stdout + result.stderr

        task = nomad_get(cluster, "/v1/job/c24-split")["TaskGroups"][0]["Tasks"][0]
        assert [
            (a["GetterSource"], a["RelativeDest"], a["GetterOptions"]["checksum"])
            for a in task["Artifacts"]
        ] == [
            (f"{server.url}/{name}", f"local/model/{name}", f"sha256:{digest}")
            for name, digest in zip(SHARDS, sums, strict=True)
        ]
        assert task["Config"]["args"][:2] == ["--model", f"local/model/{SHARDS[0]}"]
        # apply read each shard's header by range requests; Nomad fetched each whole once.
        assert sorted(server.requests) == [f"/{name}" for name in SHARDS]
        assert {path for path, _, _ in server.ranges} == {f"/{name}" for name in SHARDS}
        answer = wait_for(lambda: completion(router, "c24-split"), 15, "a completion")
        assert answer["usage"]["completion_tokens"] > 0
    finally:
        server.close()
        forget_models(cluster, "c24-split")


def test_c24_a_shard_that_cannot_be_fetched_is_refused_at_apply(
    cluster: Cluster,
    planner: Callable,
    test_ca: TlsCA,
    model_files: Callable[..., Path],
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    first = write_tiny_gguf(site / "tiny.gguf", split_max_tensors=8)
    (site / SHARDS[2]).unlink()
    server = serve_https(site, test_ca)
    try:
        folder = model_files("c24-missing", source=f"{server.url}/{first.name}", profile=PROFILE)
        result = planner("apply", str(folder))
        assert result.returncode == 2, result.stderr
        assert (
            f"{folder}/c24-missing.yaml: source: {server.url}/{SHARDS[2]}: HTTP 404"
            in result.stderr
        )
        assert not registered(cluster, "c24-missing")
        assert server.requests == []
    finally:
        server.close()
