"""The alerting rules (monitoring/llmgw.rules.yml) under Prometheus's own promtool:
the file is valid, and every alert's firing and silent cases in
monitoring/llmgw.rules.test.yml hold (a parked model fires ModelParked and
ModelNotReady, an idle on-demand model fires nothing, ...).

promtool comes from the bootstrap (Debian bookworm's prometheus package), hence
an integration test; it needs no agents and takes about a second.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from devcluster.bootstrap import BIN

pytestmark = pytest.mark.integration

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
RULES = MONITORING / "llmgw.rules.yml"
RULE_TESTS = MONITORING / "llmgw.rules.test.yml"


def promtool(*args: str) -> None:
    """Run `promtool ARGS`; fail the test with its output unless it exits 0."""
    tool = BIN / "promtool"
    if not tool.exists():
        pytest.fail(f"{tool} is missing: run `make bootstrap` first")
    proc = subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.fail(
            f"promtool {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}",
            pytrace=False,
        )


def test_rules_file_is_valid() -> None:
    promtool("check", "rules", str(RULES))


def test_every_alert_fires_and_stays_silent_as_its_cases_say() -> None:
    promtool("test", "rules", str(RULE_TESTS))
