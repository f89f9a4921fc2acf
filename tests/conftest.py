"""Suite-wide fixtures: tiny random models (built once per session) and SmolLM2 (imported once per machine)."""

import os

# Before anything imports transformers / huggingface_hub: the suite never touches a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Before anything loads OpenMP (torch): a thread waiting at the end of a parallel region sleeps
# instead of spinning. With both cores taken (a stack's workers, another job on the box) the spinning
# thread held the core its partner needed: Hugging Face's bf16 generate took 11 s against 3 s, and
# tests/engine 5 min against 1.5. The processes the tests start inherit it; a value set outside stays.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as an HF folder in the default cache dir (imported on first use)."""
    from tandem.engine.models.source import resolve_model

    return resolve_model("smollm2-135m")
