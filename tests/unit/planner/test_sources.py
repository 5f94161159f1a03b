"""Split GGUF sources (C24): the first shard stands for every shard, each fetched under
its own name; a definition naming another shard, or a sha256 list of the wrong
length, is refused with what to write instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from planner.definitions import ModelDefinition, parse_file
from planner.sources import Shard, split_of

SUMS = [f"{i:x}" * 64 for i in range(1, 4)]


def definition(source: str, sha256: object = None) -> ModelDefinition:
    return ModelDefinition.model_validate({"name": "m", "source": source, "sha256": sha256,
                                           "profile": {}})


def test_split_names_follow_llama_cpp() -> None:
    split = split_of("qwen-7b-q4-00001-of-00003.gguf")
    assert split is not None and (split.prefix, split.number, split.count) == \
        ("qwen-7b-q4", 1, 3)
    assert split.name(3) == "qwen-7b-q4-00003-of-00003.gguf"
    assert split_of("model.gguf") is None
    assert split_of("m-00001-of-00001.gguf") is None  # one file is not a split


def test_an_https_split_expands_to_every_shard_under_its_own_name() -> None:
    model = definition("https://h/models/tiny-00001-of-00003.gguf", SUMS)
    assert model.shards == [
        Shard(None, f"https://h/models/tiny-0000{i}-of-00003.gguf",
              f"tiny-0000{i}-of-00003.gguf", SUMS[i - 1]) for i in (1, 2, 3)]


def test_hf_and_file_splits_expand_too() -> None:
    hf = definition("hf://org/repo@v1/dir/a b-00001-of-00002.gguf")
    assert [s.url for s in hf.shards] == [
        f"https://huggingface.co/org/repo/resolve/v1/dir/a%20b-0000{i}-of-00002.gguf"
        for i in (1, 2)]
    local = definition("file:///models/x-00001-of-00002.gguf")
    assert [(s.local_path, s.url) for s in local.shards] == [
        ("/models/x-00001-of-00002.gguf", None), ("/models/x-00002-of-00002.gguf", None)]


def test_a_single_download_keeps_its_old_name() -> None:
    [shard] = definition("https://h/weights.gguf", SUMS[0]).shards
    assert (shard.file, shard.sha256) == ("model.gguf", SUMS[0])


@pytest.mark.parametrize(("source", "sha256", "expected"), [
    ("https://h/t-00002-of-00003.gguf", None,
     "source names shard 2 of a 3-file split model; name its first, t-00001-of-00003.gguf"),
    ("https://h/t-00001-of-00003.gguf", SUMS[:2],
     "sha256 is a list of 2: a list is one sha256 per shard of a split source (3 here)"),
    ("https://h/t-00001-of-00003.gguf", SUMS[0],
     "the source is split in 3 files: give sha256 as a list of 3, one per shard in order"),
    ("https://h/t.gguf", SUMS, "sha256 is a list, but the source is one file"),
    ("https://h/t.gguf", ["abc"], "expected a sha256 (64 hex digits) or a list of them"),
])
def test_split_mistakes_are_refused(source: str, sha256: object, expected: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(expected)):
        definition(source, sha256)


def test_a_sha256_list_is_kept_in_the_record_and_the_hash() -> None:
    split = definition("https://h/t-00001-of-00003.gguf", [s.upper() for s in SUMS])
    assert split.record().sha256 == SUMS
    other = definition("https://h/t-00001-of-00003.gguf", [*SUMS[:2], SUMS[0]])
    assert split.definition_hash != other.definition_hash


@pytest.mark.parametrize(("source", "sha256", "field", "got"), [
    ("https://h/t-00002-of-00003.gguf", None, "source", "'https://h/t-00002-of-00003.gguf'"),
    ("https://h/t-00001-of-00003.gguf", SUMS[:2], "sha256", repr(SUMS[:2])),
    ("https://h/t.gguf", SUMS, "sha256", repr(SUMS)),
    ("file:///opt/llmgw/models/t.gguf", SUMS[0], "sha256", repr(SUMS[0])),
])
def test_a_split_or_sha256_error_names_its_field_and_only_its_value(
        tmp_path: Path, source: str, sha256: object, field: str, got: str) -> None:
    file = tmp_path / "m.yaml"
    file.write_text(yaml.safe_dump({"name": "m", "source": source, "sha256": sha256,
                                    "profile": {"memory": "1GiB"}}))
    _, [problem] = parse_file(file)
    assert problem.field == field
    assert problem.message.endswith(f"(got {got})") and "profile" not in problem.message
