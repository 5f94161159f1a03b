"""The flag table and its judge (issue 18: a model file's args stay inside its model).

The table against the real `llama-server --help` is tests/integration/
test_llama_server_flags.py; here: the table parses, agrees with the other readers of
args, and the argv walk reads values as llama-server does."""

from __future__ import annotations

import pytest

from planner.engines import fitargs
from planner.engines.llama_cpp import ENGINE
from planner.engines.llama_server_flags import (
    WHY,
    FlagClass,
    judge,
    parse_head,
    parse_table,
    table,
)


def test_every_refused_class_says_why_and_every_option_has_one_class() -> None:
    assert set(WHY) == set(FlagClass) - {FlagClass.SERVING}
    options = table()
    assert len(options) > 300
    for flag, option in options.items():
        assert flag in option.flags and flag.startswith("-"), option


@pytest.mark.parametrize(
    ("head", "flags", "values"),
    [
        ("-t, --threads N", ("-t", "--threads"), 1),
        (
            "-kvu, --kv-unified, -no-kvu, --no-kv-unified",
            ("-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"),
            0,
        ),
        (
            "-ot, --override-tensor <tensor name pattern>=<buffer type>,...",
            ("-ot", "--override-tensor"),
            1,
        ),
        ("--control-vector-layer-range START END", ("--control-vector-layer-range",), 2),
        ("-fa, --flash-attn [on|off|auto]", ("-fa", "--flash-attn"), 1),
    ],
)
def test_an_option_is_read_as_help_writes_it(
    head: str, flags: tuple[str, ...], values: int
) -> None:
    assert parse_head(head) == (flags, values)


def test_a_flag_in_two_lines_or_an_unknown_class_is_named() -> None:
    with pytest.raises(ValueError, match=r":2: -t is already in '-t, --threads N'"):
        parse_table("serving | -t, --threads N\nfile | -t FNAME\n")
    with pytest.raises(ValueError, match=r":1: 'safe' is not a valid FlagClass"):
        parse_table("safe | -t N\n")


def test_the_flags_the_template_sets_are_its_own_or_meant_to_be_overridden() -> None:
    options = table()
    template = [a for a in ENGINE.server_args("m", 4096, 1) if a.startswith("--")]
    # A second --metrics is a no-op, -ngl is the operator's to lower (planner.spec.fit), and
    # --parallel is the profile's own slot count, which the template repeats (issue 20).
    overridable = {"--metrics", "--n-gpu-layers", "--parallel"}
    for flag in template:
        kind = options[flag].kind
        assert kind is FlagClass.TEMPLATE or flag in overridable, (flag, kind)


@pytest.mark.parametrize(
    "names",
    [
        fitargs.GPU_LAYERS,
        fitargs.CACHE_TYPE_K,
        fitargs.CACHE_TYPE_V,
        fitargs.PARALLEL,
        fitargs.UBATCH,
    ],
)
def test_the_fit_reads_every_spelling_of_its_flags(names: tuple[str, ...]) -> None:
    """planner.engines.fitargs looks flags up as written; judge refuses the '_' spellings, so
    the aliases of the table are every spelling it must know."""
    option = table()[names[0]]
    assert set(names) == set(option.flags) and option.kind is FlagClass.SERVING


def test_values_are_values_and_flags_are_flags_as_llama_server_reads_them() -> None:
    # A value that looks like a refused flag is llama-server's value, nothing more.
    assert judge(["--reverse-prompt", "--log-file", "-r", "--path"]) == []
    # A refused flag after a two-value option is still a flag.
    [(index, message)] = judge(["--control-vector-layer-range", "1", "2", "--lora", "x"])
    assert index == 3 and message.startswith("--lora reads or writes a file on the node")
    # An unknown flag's values are not counted again as stray elements.
    assert [i for i, _ in judge(["--newer-flag", "1", "2", "--path", "/"])] == [0, 3]
    # A flag with stray spaces still consumes its value.
    assert [i for i, _ in judge([" --threads", "2", "--jinja"])] == [0]
