import json
import shutil

import pytest

from tandem.engine.errors import InvalidRequest, ModelNotFound
from tandem.engine.models.source import resolve_model
from tandem.engine.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "hello world",
    "The capital of France is",
    "  two leading spaces, trailing  \n\n\ttab and digits 2024 3.14",
    "Grüße — 東京 🙂 naïve café",
    "",
]


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama) -> Tokenizer:
    return Tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def smol_tok(smollm2_path) -> Tokenizer:
    return Tokenizer(smollm2_path)


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_round_trip(tiny_tok, text):
    ids = tiny_tok.encode(text)
    assert all(0 <= i < tiny_tok.vocab_size for i in ids)
    assert tiny_tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smol_tok, text):
    assert smol_tok.decode(smol_tok.encode(text)) == text


def test_tiny_special_ids(tiny_tok):
    assert tiny_tok.vocab_size == 512
    assert tiny_tok.eos_token_ids == frozenset({2})
    assert tiny_tok.bos_token_id == 1


def test_smollm2_special_ids(smol_tok):
    assert smol_tok.vocab_size == 49152
    assert smol_tok.bos_token_id == 1
    # <|im_end|> ends a chat turn; <|endoftext|> ends a plain completion.
    assert smol_tok.eos_token_ids == frozenset({2, 0})
    assert smol_tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_smollm2_encoding_is_the_models(smol_tok):
    # No bos is added; specials in text are single tokens; digits are split one by one.
    assert smol_tok.encode("<|im_start|>user") == [1, 4093]
    assert smol_tok.encode("<|im_start|>user", add_special_tokens=False) == [1, 4093]
    assert smol_tok.convert_ids_to_tokens(smol_tok.encode("12345")) == ["1", "2", "3", "4", "5"]
    assert smol_tok.decode([1, 4093, 2]) == "user"
    assert smol_tok.decode([1, 4093, 2], skip_special_tokens=False) == "<|im_start|>user<|im_end|>"


def test_smollm2_chat_template_is_chatml(smol_tok):
    assert smol_tok.has_chat_template
    prompt = smol_tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = smol_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_tiny_chat_template(tiny_tok):
    prompt = tiny_tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tok.encode(prompt)[0] == 1


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"]])
def test_malformed_messages_are_invalid_requests(tiny_tok, messages):
    with pytest.raises(InvalidRequest) as e:
        tiny_tok.apply_chat_template(messages)
    assert e.value.param == "messages"


@pytest.fixture
def tiny_copy(tiny_llama, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama, dst)
    return dst


def test_model_without_chat_template(tiny_copy):
    (tiny_copy / "chat_template.jinja").unlink()
    cfg = json.loads((tiny_copy / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tiny_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(tiny_copy)
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_ids_merge_generation_config_list(tiny_copy):
    (tiny_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert Tokenizer(tiny_copy).eos_token_ids == frozenset({2, 7})
    (tiny_copy / "generation_config.json").unlink()
    assert Tokenizer(tiny_copy).eos_token_ids == frozenset({2})


# --- resolve_model ----------------------------------------------------------------------------


def test_resolve_existing_folder(tiny_llama):
    assert resolve_model(str(tiny_llama)) == tiny_llama.resolve()


def test_resolve_missing_folder(tmp_path):
    with pytest.raises(ModelNotFound, match="neither a known alias .*smollm2-135m.* nor an existing folder"):
        resolve_model(str(tmp_path / "nope"))


def test_resolve_unknown_alias_lists_known_ones():
    with pytest.raises(ModelNotFound, match="'llama-99b'.*smollm2-135m"):
        resolve_model("llama-99b")


def test_resolve_file_is_not_a_model(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFound, match="not a folder"):
        resolve_model(str(tmp_path / "model.gguf"))


def test_resolve_folder_without_config(tiny_copy):
    (tiny_copy / "config.json").unlink()
    with pytest.raises(ModelNotFound, match=r"lacks config\.json$"):
        resolve_model(str(tiny_copy))


def test_resolve_empty_folder_names_everything_missing(tmp_path):
    with pytest.raises(ModelNotFound, match=r"lacks config\.json, \*\.safetensors, tokenizer\.json"):
        resolve_model(str(tmp_path))
