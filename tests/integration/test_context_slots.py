"""`context` is what each request can use, on real parts (issue 20, item 2): a model
with `--parallel 2` runs llama-server with 2 slots of `context` tokens each, answers a
prompt that its whole context would have been split below, serves two requests at
once, and refuses a prompt longer than `context` with llama-server's 400.

`context: 512`, not 256: llama.cpp rounds each slot up to 256 tokens, so with 256 the
old split (256 / 2 slots, padded back to 256) would have passed this test too."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from devcluster.cluster import Cluster
from tests.conftest import forget_models, http_json, passing_endpoints, wait_for
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration

CONTEXT = 512
PROFILE = (
    f"context: {CONTEXT}\n  cpu: 100\n  memory: 512MiB\n"
    '  args: ["--threads", "1", "--parallel", "2"]'
)


def completion(router: str, model: str, prompt: str, **extra: object) -> dict:
    return http_json(
        f"{router}/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 8, **extra},
        timeout=60,
    )


def router_serves(router: str, model: str) -> bool:
    try:
        completion(router, model, "a", max_tokens=1)
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            return False
        raise
    return True


@pytest.fixture(scope="module")
def slotted(
    cluster: Cluster, planner: Callable, router: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A model of the slow test model (it streams for seconds: two requests overlap)
    with 2 slots of CONTEXT tokens; yields its replica's host:port."""
    folder = tmp_path_factory.mktemp("slots")
    slow = write_tiny_gguf(folder / "slow.gguf", width=512, layers=8)
    (folder / "models").mkdir()
    (folder / "models" / "slots.yaml").write_text(
        f"name: ctx-slots\nsource: file://{slow}\nprofile:\n  {PROFILE}\nreplicas: 1\n"
    )
    result = planner("apply", str(folder / "models"), "--wait", "--timeout", "180")
    assert result.returncode == 0, result.stdout + result.stderr
    [endpoint] = passing_endpoints(cluster, "llmgw-ctx-slots")
    wait_for(lambda: router_serves(router, "ctx-slots"), 20, "the router to serve ctx-slots")
    yield endpoint
    forget_models(cluster, "ctx-slots")


def test_llama_server_runs_two_slots_of_the_declared_context(slotted: str) -> None:
    props = http_json(f"http://{slotted}/props")
    assert props["total_slots"] == 2
    slots = http_json(f"http://{slotted}/slots")
    assert [slot["n_ctx"] for slot in slots] == [CONTEXT, CONTEXT]


def test_a_prompt_within_the_context_is_answered(router: str, slotted: str) -> None:
    # One token a byte (the test model's vocabulary): about 400 tokens, more than the
    # 256 a slot had when --ctx-size was the declared context split in two.
    answer = completion(router, "ctx-slots", "a" * 400)
    assert 400 <= answer["usage"]["prompt_tokens"] < CONTEXT
    assert answer["usage"]["completion_tokens"] > 0


def test_a_prompt_beyond_the_context_gets_400_naming_it(router: str, slotted: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        completion(router, "ctx-slots", "a" * (CONTEXT + 50))
    assert info.value.code == 400
    message = json.load(info.value)["error"]["message"]
    assert f"exceeds the available context size ({CONTEXT} tokens)" in message


def test_two_requests_run_at_once(router: str, slotted: str) -> None:
    # Both streams have their first token before either has its last: with one slot,
    # llama-server would start the second only after the first ended.
    body = json.dumps(
        {
            "model": "ctx-slots",
            "prompt": "go",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    spans: list[tuple[float, float, int]] = []
    both_sent = threading.Barrier(2)

    def stream() -> None:
        request = urllib.request.Request(
            f"{router}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        both_sent.wait(10)
        with urllib.request.urlopen(request, timeout=120) as response:
            times = [time.monotonic() for line in response if line.startswith(b"data: {")]
        spans.append((times[0], times[-1], len(times)))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(spans) == 2 and all(count > 100 for _, _, count in spans)
    assert max(first for first, _, _ in spans) < min(last for _, last, _ in spans)
