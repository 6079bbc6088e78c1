from pathlib import Path

import pytest

from megapp.data import ByteTokenizer, build_default_corpus
from megapp.testing import shutdown_worlds


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small dataset for end-to-end runs: the first ~400 kB of the standard-library
    corpus in byte tokens, as ``corpus / "stdlib"`` (.bin/.idx)."""
    root = tmp_path_factory.mktemp("pretrain_data")
    build_default_corpus(str(root / "stdlib"), ByteTokenizer(), max_bytes=400_000)
    return root


def pytest_sessionfinish(session, exitstatus):
    # Stop the shared worlds before pytest's own teardown, so no worker outlives the run.
    shutdown_worlds()
