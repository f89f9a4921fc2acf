"""The gateway's torch-free tokenizer must tokenize and template exactly like the workers' tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engine.tokenizer.tokenizer import Tokenizer
from tandem.services.gateway.chat_template import ChatTemplateError
from tandem.services.gateway.tokenizer import GatewayTokenizer

TEXTS = ["The capital of France is", " leading space", "Grüße, 東京 — naïve café ☕ 🙂 \t tabs\nnewlines",
         "<|im_start|>user\nhi<|im_end|>", "{json: [1, 2]}", ""]
CHATS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 東京"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}],
]


@pytest.mark.parametrize("fixture", ["tiny_llama", pytest.param("smollm2_path", marks=pytest.mark.slow)])
def test_matches_the_engine_tokenizer(fixture, request):
    folder = request.getfixturevalue(fixture)
    engine, gateway = Tokenizer(folder), GatewayTokenizer.from_folder(folder)
    for text in TEXTS:
        assert gateway.encode(text) == engine.encode(text), text
    for messages in CHATS:
        for gen in (True, False):
            assert gateway.apply_chat_template(messages, gen) == engine.apply_chat_template(messages, gen)


def test_template_sources_and_errors(tmp_path: Path, tiny_llama):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert GatewayTokenizer.from_folder(tmp_path).chat_template is None  # no chat_template.jinja, none in config
    with pytest.raises(ValueError, match="no chat template"):
        GatewayTokenizer.from_folder(tmp_path).apply_chat_template(CHATS[0])
    strict = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
              "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}")
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": strict}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = GatewayTokenizer.from_folder(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "東京"}]) == '<|im_start|>"東京"'
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_gateway_never_imports_torch(tiny_llama):
    code = (
        "import sys\n"
        "from tandem.services.gateway.app import Gateway, create_app\n"
        "from tandem.services.gateway.server import serve\n"
        "from tandem.services.gateway.tokenizer import GatewayTokenizer\n"
        f"tok = GatewayTokenizer.from_folder({str(tiny_llama)!r})\n"
        "tok.encode(tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])); tok.token_text(5)\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
