"""The certificate series planner and router both publish, and the collector behind them.

    llmgw_certificate_expiry_timestamp_seconds{path}  notAfter of the certificate, Unix s
    llmgw_certificate_read_success{path}              1 if the file was read and parsed

Each configured certificate file (the Nomad and Consul CA and client
certificates, and each process's own serving certificate) is read from disk at
every scrape, so a renewed file shows at once, without a restart; a file that
is missing or not PEM reads 0 in `read_success` (and has no expiry sample),
which the alert "certificate expired or unreadable" watches. For a bundle of
several certificates (a CA chain), the earliest notAfter counts: the chain
stops working when its first member expires.

Used by `planner.daemon.metrics` and `router.metrics`; the series names are part of the
alerting contract (monitoring/llmgw.rules.yml).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from cryptography import x509
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

EXPIRY = "llmgw_certificate_expiry_timestamp_seconds"
READ_SUCCESS = "llmgw_certificate_read_success"


def not_after(path: Path) -> float:
    """The earliest notAfter (Unix seconds) of the PEM certificates in `path`.
    Raises OSError when the file cannot be read, ValueError when it holds none."""
    certificates = x509.load_pem_x509_certificates(path.read_bytes())
    return min(c.not_valid_after_utc.timestamp() for c in certificates)


class CertificateCollector(Collector):
    """Reads `paths()` at every collect; configured paths that are empty are skipped."""

    def __init__(self, paths: Callable[[], Iterable[str | None]]) -> None:
        self._paths = paths

    def collect(self) -> Iterator[Metric]:
        expiry = GaugeMetricFamily(
            EXPIRY,
            "When the certificate file's certificate (the "
            "first to expire, for a bundle) stops being valid, as a "
            "Unix timestamp; read from disk at each scrape.",
            labels=["path"],
        )
        success = GaugeMetricFamily(
            READ_SUCCESS,
            "1 if the certificate file could be read "
            "and parsed at this scrape, else 0 (missing, unreadable "
            "or not PEM).",
            labels=["path"],
        )
        for path in sorted({p for p in self._paths() if p}):
            try:
                expiry.add_metric([path], not_after(Path(path)))
                success.add_metric([path], 1)
            except (OSError, ValueError):
                success.add_metric([path], 0)
        yield expiry
        yield success

    def describe(self) -> Sequence[Metric]:
        return []
