"""``router keys`` on the keys file (router.keyscli, router.keystore): add, rotate,
remove and list, their JSON, the exit codes, a bad input that leaves the file as it
was, comments, names YAML 1.1 reads as booleans, two writers racing, and the usage
rows built from shared tallies. The Consul store against a real agent is in
tests/integration/test_keys_cli.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from router.cli import cli
from router.keys import ApiKey, ApiKeys, digest
from router.keyscli import usage_of
from router.keystore import HEADER, Conflict, FileStore, Stored, edit, has_comments
from router.windows import Period, Tally, window_of

runner = CliRunner()


def keys(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``router keys ARGS``: (exit code, stdout, stderr)."""
    result = runner.invoke(cli, ["keys", *args], env=env or {})
    return result.exit_code, result.stdout, result.stderr


def test_add_rotate_remove_list_and_the_router_reads_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    file = ["--file", str(path)]
    code, out, err = keys("add", "team-a", *file, "--models", "gemma-*", "--models", "m")
    assert code == 0, err
    team_secret = out.strip()
    assert team_secret.startswith("sk-") and len(team_secret) == 46
    assert "shown only this once" in err and team_secret not in err
    assert team_secret not in path.read_text() and digest(team_secret) in path.read_text()
    code, out, err = keys(
        "add", "ops", *file, "--requests-per-minute", "60", "--tokens-per-day", "1000", "-o", "json"
    )
    assert code == 0, err
    added = json.loads(out)
    assert added["name"] == "ops" and added["models"] == ["*"]
    assert added["limits"] == {"requests_per_minute": 60, "tokens_per_day": 1000}
    ops_secret = added["key"]
    # The router's loader reads the file the CLI wrote, and both secrets work.
    loaded = ApiKeys.load(str(path))
    team = loaded.authenticate(f"Bearer {team_secret}".encode())
    assert team.models == ("gemma-*", "m")
    ops = loaded.authenticate(f"Bearer {ops_secret}".encode())
    assert (ops.requests_per_minute, ops.budget_tokens, ops.budget_period) == (60, 1000, "day")
    assert path.read_text().startswith(HEADER)

    code, out, _ = keys("list", *file, "-o", "json")
    assert code == 0
    assert json.loads(out) == [
        {"name": "team-a", "models": ["gemma-*", "m"], "limits": {}},
        {"name": "ops", "models": ["*"], "limits": added["limits"]},
    ]
    assert "sha256" not in out and team_secret not in out
    code, out, _ = keys("list", *file)
    assert code == 0 and "team-a" in out and "requests_per_minute 60" in out

    code, out, _ = keys("rotate", "team-a", *file)
    assert code == 0
    rotated = out.strip()
    loaded = ApiKeys.load(str(path))
    assert loaded.authenticate(f"Bearer {rotated}".encode()).models == ("gemma-*", "m")
    with pytest.raises(Exception, match="Incorrect API key"):
        loaded.authenticate(f"Bearer {team_secret}".encode())

    code, out, _ = keys("remove", "ops", *file, "-o", "json")
    assert code == 0 and json.loads(out)["removed"] is True
    assert list(ApiKeys.load(str(path)).by_name()) == ["team-a"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["add", "team-a"], 1, "a key named 'team-a' exists already"),
        (["rotate", "nobody"], 1, "no key named 'nobody'"),
        (["remove", "nobody"], 1, "no key named 'nobody'"),
        (["add", "x", "--requests-per-minute", "0"], 2, "limits.requests_per_minute"),
        (["add", "x", "--concurrent-requests", "-3"], 2, "limits.concurrent_requests"),
        (["add", "x", "--models", "Gemma-*"], 2, "'Gemma-*' can never match a model"),
        (["add", "x", "--models", "g[!"], 2, "'g[!' can never match a model"),
        (["add", "x", "--models", "g]!"], 2, "'g]!' can never match a model"),
        (["add", "x", "--tokens-per-day", "5", "--tokens-per-month", "9"], 2, "one budget"),
        (["add", "x", "--requests-per-minute", "many"], 2, "Error"),  # typer's own
    ],
)
def test_bad_input_is_named_and_leaves_the_file_unchanged(
    tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    path = tmp_path / "keys.yaml"
    assert keys("add", "team-a", "--file", str(path))[0] == 0
    before = path.read_bytes()
    got, out, err = keys(*args, "--file", str(path), "-o", "json")
    assert got == code, err
    assert message in err
    assert path.read_bytes() == before
    if "many" not in args:  # typer's own usage errors print no JSON
        error = json.loads(out)["error"]
        assert error["exit_code"] == code and message in error["message"]
        assert str(path) in error["message"] or "router keys add" in error["message"]


def test_no_store_named_is_exit_2_and_the_environment_names_one(tmp_path: Path) -> None:
    code, _, err = keys("list")
    assert code == 2 and "--file PATH or --consul" in err
    path = tmp_path / "keys.yaml"
    code, _, err = keys("add", "a", env={"LLMGW_API_KEYS_FILE": str(path)})
    assert code == 0, err
    assert keys("list", "-o", "json", env={"LLMGW_API_KEYS_FILE": str(path)})[0] == 0
    code, _, err = keys("list", "--file", str(path), "--consul")
    assert code == 2 and "name one store" in err


def test_a_document_the_router_would_refuse_is_not_edited(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - name: a\n    sha256: sk-a-plain-key\n")
    code, _, err = keys("add", "b", "--file", str(path))
    assert code == 2 and "keys.0.sha256" in err and "nothing was changed" in err
    assert path.read_text() == "keys:\n  - name: a\n    sha256: sk-a-plain-key\n"


def test_comments_are_kept_unless_forced(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    text = f"# team a's key, ticket 42\nkeys:\n  - name: a\n    sha256: {digest('x')}\n"
    path.write_text(text)
    code, _, err = keys("add", "b", "--file", str(path))
    assert code == 2 and "--force" in err and path.read_text() == text
    assert keys("list", "--file", str(path))[0] == 0  # reading needs no --force
    code, _, err = keys("add", "b", "--file", str(path), "--force")
    assert code == 0, err
    assert path.read_text().startswith(HEADER) and "ticket 42" not in path.read_text()
    assert not has_comments(path.read_bytes())
    assert keys("remove", "b", "--file", str(path))[0] == 0  # its own header: no --force


def test_names_yaml_reads_as_booleans_are_names(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    # Written by hand, unquoted: YAML 1.1 reads these as booleans.
    path.write_text(
        f"keys:\n  - name: on\n    sha256: {digest('a')}\n"
        f"  - name: No\n    sha256: {digest('b')}\n    models: [yes]\n"
    )
    loaded = ApiKeys.load(str(path))
    assert loaded.authenticate(b"Bearer a").name == "on"
    assert loaded.authenticate(b"Bearer b").name == "No"
    assert loaded.authenticate(b"Bearer b").models == ("yes",)
    for name in ("off", "yes"):
        code, _, err = keys("add", name, "--file", str(path))
        assert code == 0, err
    text = path.read_text()
    assert "name: 'off'" in text and "name: 'yes'" in text and "name: 'on'" in text
    assert list(ApiKeys.load(str(path)).by_name()) == ["on", "No", "off", "yes"]
    # A spelling YAML turns into something else cannot be recovered: quote it.
    path.write_text(f"keys:\n  - name: true\n    sha256: {digest('c')}\n")
    with pytest.raises(ValueError, match=r"keys\.0\.name: .*as True, not as text: quote it"):
        ApiKeys.load(str(path))


class RacedFile(FileStore):
    """The keys file, with another operator's edit landing between this edit's read and
    its write, ``races`` times."""

    def __init__(self, path: str, races: int) -> None:
        super().__init__(path)
        self.races = races
        self.writes = 0

    def write(self, document: bytes, version: str | int) -> bool:
        self.writes += 1
        if self.races > 0:
            self.races -= 1
            other = FileStore(self.path)
            edit(other, lambda e: [*e, {"name": f"other-{self.races}", "sha256": digest(
                f"other-{self.races}"
            )}])  # fmt: skip
        return super().write(document, version)


def test_an_edit_that_lost_a_race_is_applied_again_on_what_the_other_wrote(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.yaml"
    store = RacedFile(str(path), races=1)
    edit(store, lambda e: [*e, {"name": "mine", "sha256": digest("mine")}])
    assert store.writes == 2
    assert list(ApiKeys.load(str(path)).by_name()) == ["other-0", "mine"]
    # Losing every time: nothing of this edit written, a Conflict (exit 1).
    store = RacedFile(str(path), races=10)
    with pytest.raises(Conflict, match="changed by another writer 5 times"):
        edit(store, lambda e: [*e, {"name": "late", "sha256": digest("late")}])
    assert "late" not in ApiKeys.load(str(path)).by_name()
    assert Conflict.exit_code == 1


class ComparedFile(FileStore):
    """The keys file, with another `router keys` writing while this one compares the
    file's content before its rename (the compare is the read inside ``write``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.writing = False
        self.other: threading.Thread | None = None
        self.others: list[bool] = []

    def write(self, document: bytes, version: str | int) -> bool:
        self.writing = True
        return super().write(document, version)

    def read(self) -> Stored:
        if self.writing and self.other is None:
            stored = FileStore(self.path).read()
            other = b"keys:\n  - name: other\n    sha256: " + digest("o").encode() + b"\n"
            self.other = threading.Thread(
                target=lambda: self.others.append(FileStore(self.path).write(other, stored.version))
            )
            self.other.start()
            # Without the folder's lock the other's rename lands now, inside this
            # compare; with it, the other waits for this write to end (the bound only
            # lets a broken lock show: a correct one passes however long this takes).
            self.other.join(0.5)
        return super().read()


def test_two_writers_of_the_file_take_turns(tmp_path: Path) -> None:
    """Issue 23's QA: two `router keys add` of one name in the same instant both
    printed a secret, and only one was stored: a rename landed between the other's
    compare and its rename. Under the folder's lock the second writer sees the first's
    file and loses its compare (then `edit` applies its change again)."""
    path = tmp_path / "keys.yaml"
    path.write_text("keys: []\n")
    store = ComparedFile(str(path))
    version = store.read().version
    assert store.write(b"keys:\n  - name: mine\n    sha256: " + digest("m").encode() + b"\n",
                       version)  # fmt: skip
    assert store.other is not None
    store.other.join(10)
    assert store.others == [False]
    assert list(ApiKeys.load(str(path)).by_name()) == ["mine"]


def test_file_store_versions() -> None:
    assert Stored(None, "").document is None
    assert has_comments(b"keys: []  # none yet\n")
    assert not has_comments(HEADER.encode() + b"keys: []\n")


def test_usage_rows_from_the_shared_tallies() -> None:
    wall = 1_764_669_630.0  # 2025-12-02 10:00:30 UTC
    minute, _ = window_of(Period.MINUTE, wall)
    key = ApiKey(
        "team",
        ("*",),
        requests_per_minute=10,
        concurrent_requests=2,
        budget_tokens=1000,
        budget_period="day",
        tokens_per_minute=500,
    )
    tallies = {
        "requests": Tally(minute, 4),
        "tokens-minute": Tally(str(int(minute) - 1), 400),  # last minute's: 0 now
        # no tokens-day document
    }
    rows = {row["limit"]: row for row in usage_of(key, tallies, wall)}
    assert rows["requests_per_minute"] == {
        "limit": "requests_per_minute",
        "value": 10,
        "window": minute,
        "used": 4,
        "remaining": 6,
        "resets_in_s": 30.0,
        "shared": True,
    }
    assert rows["tokens_per_minute"]["used"] == 0 and rows["tokens_per_minute"]["shared"]
    day = rows["tokens_per_day"]
    assert (day["window"], day["used"], day["shared"]) == ("2025-12-02", 0, False)
    assert rows["concurrent_requests"]["used"] is None
    assert usage_of(ApiKey("free", ("*",)), {}, wall) == []


@pytest.mark.parametrize(
    "name",
    [
        "a\nb",
        "tab\there",
        "x" * 129,
        "a\u2028b",
        "zero\u200bwidth",
        "rtl\u202e",
        "c1\x85",
        " ops",
        "ops ",
    ],
)
def test_a_name_that_is_not_one_printable_line_of_128_characters_is_refused(
    tmp_path: Path, name: str
) -> None:
    path = tmp_path / "keys.yaml"
    runner = CliRunner()
    answer = runner.invoke(cli, ["keys", "add", name, "--file", str(path)])
    assert answer.exit_code == 2, answer.output
    assert not path.exists()
    assert ApiKeys.parse(b"keys:\n  - name: 'a b/c'\n    sha256: " + digest("x").encode(), "t")
    assert ApiKeys.parse(
        "keys:\n  - name: 'équipe ä'\n    sha256: ".encode() + digest("x").encode(), "t"
    )


def test_a_name_holding_a_hash_is_no_comment(tmp_path: Path) -> None:
    """Issue 23's second QA: after `add "a #b"` every later edit of the file asked for
    --force ("has comments"): the quoted name's `#` was taken for one."""
    path = tmp_path / "keys.yaml"
    runner = CliRunner()
    for name in ("a #b", "c"):
        answer = runner.invoke(cli, ["keys", "add", name, "--file", str(path)])
        assert answer.exit_code == 0, answer.output
    assert list(ApiKeys.load(str(path)).by_name()) == ["a #b", "c"]
    assert has_comments(b"keys: []  # a note\n")


@pytest.mark.parametrize("command", [["list"], ["usage"], ["remove", "ops"], ["rotate", "ops"]])
def test_reading_keys_where_there_are_none_says_so(tmp_path: Path, command: list[str]) -> None:
    """A mistyped --file is no empty set of keys, nor a missing key: exit 1 naming the
    place."""
    path = tmp_path / "typo.yaml"
    answer = CliRunner().invoke(cli, ["keys", *command, "--file", str(path)])
    assert answer.exit_code == 1, answer.output
    assert f"keys file {path}: there is none" in answer.output
    assert not path.exists()
