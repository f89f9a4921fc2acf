"""Fixtures shared by the benchmark tests."""

import pytest

from tests.bench.fakes import byte_level_bpe


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A folder with a small byte-level BPE tokenizer.json (no model)."""
    d = tmp_path_factory.mktemp("tok")
    byte_level_bpe().save(str(d / "tokenizer.json"))
    return d
