"""Split GGUF sources (C24): the first shard stands for every shard, each fetched under
its own name; a definition naming another shard, or a sha256 list of the wrong
length, is refused with what to write instead. And what a source puts in the job:
no `${` after any decoding (issue 18, D3), no file:// path that reads as other than the
node opens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from planner.spec.definitions import ModelDefinition, parse_file
from planner.spec.jobspec import variables
from planner.spec.settings import Settings
from planner.spec.sources import Shard, interpolated, source_name, split_of

SUMS = [f"{i:x}" * 64 for i in range(1, 4)]


def definition(source: str, sha256: object = None) -> ModelDefinition:
    return ModelDefinition.model_validate(
        {"name": "m", "source": source, "sha256": sha256, "profile": {}}
    )


def test_split_names_follow_llama_cpp() -> None:
    split = split_of("qwen-7b-q4-00001-of-00003.gguf")
    assert split is not None and (split.prefix, split.number, split.count) == ("qwen-7b-q4", 1, 3)
    assert split.name(3) == "qwen-7b-q4-00003-of-00003.gguf"
    assert split_of("model.gguf") is None
    assert split_of("m-00001-of-00001.gguf") is None  # one file is not a split


def test_an_https_split_expands_to_every_shard_under_its_own_name() -> None:
    model = definition("https://h/models/tiny-00001-of-00003.gguf", SUMS)
    assert model.shards == [
        Shard(
            None,
            f"https://h/models/tiny-0000{i}-of-00003.gguf",
            f"tiny-0000{i}-of-00003.gguf",
            SUMS[i - 1],
        )
        for i in (1, 2, 3)
    ]


def test_hf_and_file_splits_expand_too() -> None:
    hf = definition("hf://org/repo@v1/a dir/b-00001-of-00002.gguf")
    assert [s.url for s in hf.shards] == [
        f"https://huggingface.co/org/repo/resolve/v1/a%20dir/b-0000{i}-of-00002.gguf"
        for i in (1, 2)
    ]
    local = definition("file:///models/x-00001-of-00002.gguf")
    assert [(s.local_path, s.url) for s in local.shards] == [
        ("/models/x-00001-of-00002.gguf", None),
        ("/models/x-00002-of-00002.gguf", None),
    ]


def test_a_single_download_keeps_its_old_name() -> None:
    [shard] = definition("https://h/weights.gguf", SUMS[0]).shards
    assert (shard.file, shard.sha256) == ("model.gguf", SUMS[0])


@pytest.mark.parametrize(
    ("source", "sha256", "expected"),
    [
        (
            "https://h/t-00002-of-00003.gguf",
            None,
            "source names shard 2 of a 3-file split model; name its first, t-00001-of-00003.gguf",
        ),
        (
            "https://h/t-00001-of-00003.gguf",
            SUMS[:2],
            "sha256 is a list of 2: a list is one sha256 per shard of a split source (3 here)",
        ),
        (
            "https://h/t-00001-of-00003.gguf",
            SUMS[0],
            "the source is split in 3 files: give sha256 as a list of 3, one per shard in order",
        ),
        ("https://h/t.gguf", SUMS, "sha256 is a list, but the source is one file"),
        ("https://h/t.gguf", ["abc"], "expected a sha256 (64 hex digits) or a list of them"),
    ],
)
def test_split_mistakes_are_refused(source: str, sha256: object, expected: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(expected)):
        definition(source, sha256)


def test_a_sha256_list_is_kept_in_the_record_and_the_hash() -> None:
    split = definition("https://h/t-00001-of-00003.gguf", [s.upper() for s in SUMS])
    assert split.record().sha256 == SUMS
    other = definition("https://h/t-00001-of-00003.gguf", [*SUMS[:2], SUMS[0]])
    assert split.definition_hash != other.definition_hash


@pytest.mark.parametrize(
    ("source", "sha256", "field", "got"),
    [
        ("https://h/t-00002-of-00003.gguf", None, "source", "'https://h/t-00002-of-00003.gguf'"),
        ("https://h/t-00001-of-00003.gguf", SUMS[:2], "sha256", repr(SUMS[:2])),
        ("https://h/t.gguf", SUMS, "sha256", repr(SUMS)),
        ("file:///opt/llmgw/models/t.gguf", SUMS[0], "sha256", repr(SUMS[0])),
    ],
)
def test_a_split_or_sha256_error_names_its_field_and_only_its_value(
    tmp_path: Path, source: str, sha256: object, field: str, got: str
) -> None:
    file = tmp_path / "m.yaml"
    file.write_text(
        yaml.safe_dump(
            {"name": "m", "source": source, "sha256": sha256, "profile": {"memory": "1GiB"}}
        )
    )
    _, [problem] = parse_file(file)
    assert problem.field == field
    assert problem.message.endswith(f"(got {got})") and "profile" not in problem.message


# Issue 18 QA, D3: a percent-encoded `${` in a split URL reached the artifact's destination
# and the task's args decoded (Nomad interpolated it to the node's name); and the QA's
# file:// paths that no node decodes, which parked the model on a file not found.
MISLEADING = [
    (
        "https://127.0.0.1:8443/%24%7Bnode.unique.name%7D-00001-of-00002.gguf",
        "the file name '${node.unique.name}-00001-of-00002.gguf' (percent-decoded) is not a "
        "plain file name (letters, digits, '.', '_', '+', '-'; first a letter or digit): each "
        "shard of a split source is saved under its own name on the node",
    ),
    ("https://h/%24%7bmeta.x%7d-00001-of-00002.gguf", "'${meta.x}-00001-of-00002.gguf'"),
    (
        "hf://org/repo/%24%7Bnode.unique.name%7D-00001-of-00002.gguf",
        "'%24%7Bnode.unique.name%7D-00001-of-00002.gguf' (percent-decoded) is not a plain",
    ),
    ("https://h/x/..%2F..%2Fetc-00001-of-00002.gguf", "'../../etc-00001-of-00002.gguf'"),
    ("https://h/a%2Fb-00001-of-00002.gguf", "'a/b-00001-of-00002.gguf'"),
    ("https://h/.hidden-00001-of-00002.gguf", "'.hidden-00001-of-00002.gguf'"),
    # URL parsing drops tabs and newlines: '$\n{' would become '${' after the check.
    (
        "https://h/$\n{node.unique.name}-00001-of-00002.gguf",
        "the source contains the control character '\\n'",
    ),
    ("https://h/$\t{node.unique.name}.gguf", "the control character '\\t'"),
    ("file:///opt/llmgw/models/$\r{NOMAD_ALLOC_ID}.gguf", "the control character '\\r'"),
    ("file:///opt/llmgw/models/\x00.gguf", "the control character '\\x00'"),
    (
        "file:///opt/llmgw/models/%2e%2e/%2e%2e/etc/shadow",
        "/opt/llmgw/models/%2e%2e/%2e%2e/etc/shadow has a '%': the node opens the path as "
        "written and decodes nothing",
    ),
    ("file:///opt/llmgw/models/..%2f..%2fetc/shadow", "has a '%'"),
    (
        "file:///opt/llmgw/models/..\\..\\etc\\shadow",
        "/opt/llmgw/models/..\\..\\etc\\shadow has a '\\': node paths are separated by '/' only",
    ),
    (
        "file:///opt/llmgw/models/./m.gguf",
        "/opt/llmgw/models/./m.gguf has a '.' segment; name the file by its plain path",
    ),
    ("file:///opt/llmgw/models/../m.gguf", "has a '..' segment"),
]


@pytest.mark.parametrize(("source", "expected"), MISLEADING)
def test_sources_whose_decoded_or_written_text_misleads_are_refused(
    source: str, expected: str
) -> None:
    with pytest.raises(ValidationError) as info:
        definition(source)
    [error] = info.value.errors()
    assert error["loc"] == ("source",) and expected in error["msg"], error["msg"]


# Nomad's own runtime interpolations, which the engine's arguments carry on purpose.
NOMAD_PLACEHOLDERS = ("${NOMAD_IP_http}", "${NOMAD_PORT_http}")


@pytest.mark.parametrize(
    "source",
    [
        # Accepted: the name of a single download is not in the job (it is saved as
        # model.gguf) and its URL goes to Nomad as written, never decoded before Nomad
        # interpolates it.
        "https://127.0.0.1:8443/%24%7Bnode.unique.name%7D.gguf",
        "https://h/%24%7Bmeta.dir%7D/m-00001-of-00002.gguf",
        "https://h/m-00001-of-00002.gguf?x=%24%7Bnode.unique.id%7D",
        "hf://org/repo/%24%7Bnode.unique.name%7D.gguf",
        "hf://org/repo@v1/%24%7Bmeta.x%7D/m-00001-of-00002.gguf",
        "file:///opt/llmgw/models/m-00001-of-00002.gguf",
        *(source for source, _ in MISLEADING),
    ],
)
def test_no_text_the_job_carries_from_a_source_holds_an_interpolation(source: str) -> None:
    """The whole kind of D3: every source is refused, or renders no `${` of its own."""
    try:
        model = definition(source)
    except ValidationError:
        return
    values = variables(model, Settings())
    rendered = json.dumps(values) + model.record().model_dump_json()
    for placeholder in NOMAD_PLACEHOLDERS:
        rendered = rendered.replace(placeholder, "")
    assert "${" not in rendered, rendered


def test_a_url_file_name_is_decoded_from_its_last_segment_only() -> None:
    assert source_name(None, "https://h/dir/a%2Fb.gguf") == "a/b.gguf"
    assert source_name(None, "https://h/a%20dir/b.gguf") == "b.gguf"
    assert source_name(None, "https://h/models/") == ""
    assert source_name("/m/%24x.gguf", None) == "%24x.gguf"  # a node decodes nothing


def test_the_guard_names_any_derived_text_that_holds_an_interpolation() -> None:
    assert interpolated([Shard(None, "https://h/a.gguf", "${x}.gguf")]) == "${x}.gguf"
    assert interpolated([Shard("/m/a.gguf", None, "a.gguf")]) is None
