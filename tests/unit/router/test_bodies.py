"""Finding the model in a request body (router.bodies), and the bounded URL cache."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from router import errors
from router.bodies import BodyParser, extract_model, parse_request
from router.catalog import ServiceAddress
from router.endpoint import URL_CACHE_SIZE, Endpoint
from tests.support.router_harness import run


def test_small_bodies_are_parsed_inline_with_clear_errors() -> None:
    async def scenario() -> None:
        parser = BodyParser()
        assert await parser.find_model(b'{"prompt": "x", "model": "m"}') == "m"
        for bad, param in (
            (b"{", None),
            (b"[]", None),
            (b"{}", "model"),
            (b'{"model": 3}', "model"),
        ):
            with pytest.raises(errors.InvalidRequest) as err:
                await parser.find_model(bad)
            assert err.value.param == param

    run(scenario())


def test_a_body_nested_too_deep_is_a_clear_error_small_or_huge() -> None:
    """json's RecursionError is not a ValueError: let out, a client's 10 KB of `[` was
    a 500 on the loop and ended the worker that parses huge bodies (review)."""
    nested = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b', "model": "m"}'

    async def scenario() -> None:
        inline, worker = BodyParser(), BodyParser(inline_bytes=1024)
        try:
            for parser in (inline, worker):
                with pytest.raises(errors.InvalidRequest):
                    await parser.find_model(nested)
            later = b'{"prompt": "' + b"x" * 2000 + b'", "model": "m"}'
            assert await worker.find_model(later) == "m"  # the worker process still serves
        finally:
            await inline.close()
            await worker.close()

    run(scenario(), timeout=60)


def test_a_huge_body_never_stalls_the_loop() -> None:
    # The OpenAI SDK puts `messages` before `model`: the model is at the end.
    messages = [{"role": "user", "content": "x" * 1000}] * 30_000
    body = json.dumps({"messages": messages, "model": "late"}).encode()
    first = json.dumps({"model": "early", "messages": messages}).encode()
    assert len(body) > 30_000_000

    async def scenario() -> None:
        parser = BodyParser()
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        try:
            assert await parser.find_model(first) == "early"  # first key: no parse
            assert await parser.find_model(body) == "late"  # in the worker process
            with pytest.raises(errors.InvalidRequest):
                await parser.find_model(body[:-1])
        finally:
            stop.set()
            await tick
            await parser.close()
        # json.loads of this body on the loop takes ~0.8 s; handing it to the
        # worker is a copy.
        assert max(gaps) < 0.3, max(gaps)

    run(scenario(), timeout=60)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "temperature": NaN}',
        b'{"model": "m", "prompt": "\\ud800"}',
        b'\xef\xbb\xbf{"model": "m"}',
        b'{"model": "m", "x": 1e400}',
        b'{"model": "m", "model": "n"}',
    ],
)
def test_the_fast_parse_accepts_what_json_accepts(body: bytes) -> None:
    # orjson refuses these; json (and so llama-server's clients' tools) accept them.
    model, doc = parse_request(body)
    assert doc == json.loads(body) or "NaN" in body.decode("utf-8-sig")
    assert model == json.loads(body)["model"]


def test_a_body_json_finds_too_deep_is_refused_though_orjson_would_take_it() -> None:
    # orjson parses 1,024 levels; json stops at its recursion limit (found in review:
    # 1,000 levels were served, or failed with a 500 when re-parsed for usage).
    deep = b'{"model": "m", "x": ' + b"[" * 1010 + b"]" * 1010 + b"}"
    with pytest.raises(RecursionError):
        json.loads(deep)
    with pytest.raises(errors.InvalidRequest, match="not valid JSON"):
        parse_request(deep)


def test_the_fast_parse_refuses_with_jsons_words() -> None:
    with pytest.raises(errors.InvalidRequest) as refused:
        parse_request(b'{"model": "m",')
    try:
        json.loads(b'{"model": "m",')
    except ValueError as exc:
        assert str(exc) in refused.value.message


def test_extract_model_is_the_inline_parse() -> None:
    assert extract_model(b'{"model": "m"}') == "m"


def test_the_url_cache_is_bounded() -> None:
    endpoint = Endpoint(ServiceAddress("10.0.0.1", 9000), 4)
    for i in range(1000):
        assert str(endpoint.url(f"/v1/completions?nonce={i}")).endswith(f"nonce={i}")
    assert len(endpoint._urls) == URL_CACHE_SIZE


def test_a_huge_body_names_the_model_a_small_one_would() -> None:
    # JSON's last "model" wins in the full parse; the first-key shortcut must agree.
    padding = "x" * 300_000
    body = json.dumps({"model": "first", "prompt": padding}).encode()
    twice = body[:-1] + b', "model": "last"}'

    async def scenario() -> None:
        parser = BodyParser()
        try:
            assert await parser.find_model(body) == "first"
            assert await parser.find_model(twice) == "last"
            assert extract_model(twice) == "last"
        finally:
            await parser.close()

    run(scenario())
