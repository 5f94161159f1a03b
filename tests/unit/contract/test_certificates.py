"""The certificate collector: read from disk at each scrape, earliest notAfter of a bundle,
0 in read_success for a file that is missing or not PEM."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw_contract.certificates import EXPIRY, READ_SUCCESS, CertificateCollector, not_after
from tests.support.tls import make_ca


def folder(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def scrape(paths: list[str | None]) -> dict[tuple[str, str], float]:
    """{(series, path): value} of one scrape."""
    registry = CollectorRegistry()
    registry.register(CertificateCollector(lambda: paths))
    text = generate_latest(registry).decode()
    return {
        (sample.name, sample.labels["path"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_expiry_and_success_per_path_read_at_each_scrape(tmp_path: Path) -> None:
    ca = make_ca(folder(tmp_path / "ca"))
    missing = str(tmp_path / "gone.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    samples = scrape([str(ca.cert), missing, str(garbage), None, ""])
    assert samples == {
        (EXPIRY, str(ca.cert)): not_after(ca.cert),
        (READ_SUCCESS, str(ca.cert)): 1,
        (READ_SUCCESS, missing): 0,
        (READ_SUCCESS, str(garbage)): 0,
    }
    # A renewed file shows at the next scrape, no restart.
    other = make_ca(folder(tmp_path / "ca2"))
    garbage.write_bytes(other.cert.read_bytes())
    assert scrape([str(garbage)])[(READ_SUCCESS, str(garbage))] == 1


def test_a_bundle_counts_its_first_certificate_to_expire(tmp_path: Path) -> None:
    a, b = make_ca(folder(tmp_path / "a")), make_ca(folder(tmp_path / "b"))
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(a.cert.read_bytes() + b.cert.read_bytes())
    assert not_after(bundle) == min(not_after(a.cert), not_after(b.cert))
