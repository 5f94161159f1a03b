"""router.metrics: counts kept as plain ints on the request path are folded into
their counters whenever the registry is read, once."""

from __future__ import annotations

from router.accounting import Usage
from router.metrics import RouterMetrics


def test_request_counts_are_folded_at_each_read_and_never_twice() -> None:
    metrics = RouterMetrics()
    metrics.model_defined("m")
    bound = metrics.for_model("m")
    for status in (200, 200, 502):
        bound.observe(status, 0.01)
        bound.account("k", status, False, Usage(5, 2, 3) if status == 200 else None)

    def read(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model": "m", **labels})

    for _ in range(2):  # a second read adds nothing
        assert read("llmgw_router_requests_total", code="200") == 2
        assert read("llmgw_router_requests_total", code="502") == 1
        assert read("llmgw_router_key_requests_total", key="k", outcome="ok") == 2
        assert read("llmgw_router_key_requests_total", key="k", outcome="upstream_error") == 1
        assert read("llmgw_router_tokens_total", key="k", type="prompt") == 10
        assert read("llmgw_router_tokens_total", key="k", type="cached_prompt") == 4
        assert read("llmgw_router_tokens_total", key="k", type="completion") == 6
    bound.observe(200, 0.01)
    text = metrics.exposition()[0].decode()
    assert 'llmgw_router_requests_total{code="200",model="m"} 3.0' in text
    metrics.model_removed("m")
    assert "llmgw_router_requests_total{" not in metrics.exposition()[0].decode()
