"""Fixtures of the integration tests only (the shared ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.bootstrap import NODE_MODELS


@pytest.fixture(scope="session", autouse=True)
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The planner's models roots (LLMGW_MODELS_ROOT) in these tests: the session's base
    temporary folder, under which every test writes its GGUF files, and the dev node's
    /opt/llmgw/models, where the bootstrap put the demo model (C18 and the update tests
    serve Gemma from there). Set in os.environ
    before any other fixture runs, so every planner environment built from it (the CLI's,
    the daemons', each test module's own) has it."""
    root = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMGW_MODELS_ROOT", f"{root}:{NODE_MODELS}")
        yield root
