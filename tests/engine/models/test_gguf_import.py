import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from tandem.engine.models import gguf_import, source
from tandem.engine.models.gguf_import import MARKER_FILE, import_gguf, unpermute_qk
from tandem.engine.models.source import PackagedGguf, resolve_model

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to HF's Q and K rows.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim,shape_in", [(9, 64, (12,)), (3, 8, (5,)), (4, 16, ())])
def test_unpermute_undoes_llama_cpp_permutation(n_head, head_dim, shape_in):
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, *shape_in)).astype(np.float32)
    permuted = permute_like_llama_cpp(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


def test_unpermute_pairs_rotary_halves():
    # One head of dim 4: llama.cpp interleaves the halves [r0, r1 | r2, r3] → [r0, r2, r1, r3].
    rows = np.array([[0.0], [2.0], [1.0], [3.0]], dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(rows, 1).ravel(), [0.0, 1.0, 2.0, 3.0])


_HF_TO_GGUF_LAYER = {v: k for k, v in gguf_import._LAYER_NAMES.items()}
_HF_TO_GGUF_GLOBAL = {v: k for k, v in gguf_import._GLOBAL_NAMES.items()}


def _gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        return f"blk.{layer}.{_HF_TO_GGUF_LAYER[part]}.{kind}"
    return f"{_HF_TO_GGUF_GLOBAL[base]}.{kind}"


# Quantized like SmolLM2's GGUF; the others stay F32, as norms do there.
_QUANTIZE = {"attn_q": Q4_1, "ffn_down": Q4_1, "token_embd": Q8_0}


def write_tiny_gguf(hf_dir: Path, out: Path, sampling: dict | None = None) -> dict[str, np.ndarray]:
    """Write `hf_dir` (a tiny llama) as llama.cpp would; return the HF tensors the import must give.
    `sampling`: general.sampling.* values, as llama.cpp's converter copies them from generation_config.json."""
    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    weights = load_file(hf_dir / "model.safetensors")
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    w = gguf.GGUFWriter(out, arch="llama")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template("{{ messages[0]['content'] }}")
    for name, value in (sampling or {}).items():
        getattr(w, f"add_sampling_{name}")(value)

    expected = {}
    for name, t in weights.items():
        gname = _gguf_name(name)
        stored = t
        if gname.endswith("attn_q.weight"):
            stored = permute_like_llama_cpp(t, n_head)
        elif gname.endswith("attn_k.weight"):
            stored = permute_like_llama_cpp(t, n_kv)
        # Quantize a few tensors so the import's dequantization and byte-shape handling are exercised.
        qtype = _QUANTIZE.get(gname.split(".")[-2])
        if qtype is None:
            w.add_tensor(gname, stored)
            expected[name] = t
        else:
            q = gguf.quantize(stored, qtype)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qtype)
            expected[name] = gguf.dequantize(gguf.quantize(t, qtype), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(tiny_llama, path)


def test_import_reproduces_hf_weights_config_and_tokenizer(tiny_llama, tiny_gguf, tmp_path):
    from transformers import AutoTokenizer

    src, expected = tiny_gguf
    out = import_gguf(src, tmp_path / "model", progress=False)

    got = load_file(out / "model.safetensors")
    assert got.keys() == expected.keys()  # untied: lm_head present
    for name, t in expected.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], t, err_msg=name)

    ref = json.loads((tiny_llama / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert cfg[key] == ref[key], key
    assert cfg["rope_theta"] == pytest.approx(ref["rope_theta"])
    assert cfg["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"])
    assert json.loads((out / MARKER_FILE).read_text())["importer_version"] == gguf_import.IMPORTER_VERSION

    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_llama)
    for text in [
        "hello world, the model 123!",
        "Grüße 東京  two  spaces\n",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == text
    assert ours.chat_template == "{{ messages[0]['content'] }}"


def test_imported_tiny_model_runs_like_the_original(tiny_llama, tiny_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    src, expected = tiny_gguf
    out = import_gguf(src, tmp_path / "model", progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    # The reference gets the same quantization error the GGUF carries.
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()})
    ids = torch.tensor([[5, 17, 300, 42, 99, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


def test_generation_config_carries_the_sampling_defaults_the_gguf_has_and_no_others(tiny_llama, tiny_gguf, tmp_path):
    from tandem.engine.models.config import generation_defaults

    plain = import_gguf(tiny_gguf[0], tmp_path / "plain", progress=False)
    assert generation_defaults(plain) == {}                 # SmolLM2's case: its authors published none
    src = tmp_path / "sampling.gguf"
    write_tiny_gguf(tiny_llama, src, {"temp": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "penalty_repeat": 1.1})
    out = import_gguf(src, tmp_path / "sampling", progress=False)
    assert generation_defaults(out) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05}


def test_import_refuses_an_existing_folder(tiny_gguf, tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(FileExistsError):
        import_gguf(tiny_gguf[0], tmp_path / "model", progress=False)


def test_failed_import_leaves_nothing_behind(tiny_gguf, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_import, "_write_tokenizer", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        import_gguf(tiny_gguf[0], tmp_path / "model", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_import_rejects_other_architectures(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "x.gguf", arch="gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "model", progress=False)
    assert not (tmp_path / "model").exists()


@pytest.fixture
def tiny_alias(tiny_gguf, monkeypatch):
    """Registers alias "tiny" for the tiny GGUF and counts imports."""
    src = tiny_gguf[0]
    monkeypatch.setitem(source.KNOWN_MODELS, "tiny", PackagedGguf("unused", "unused", src.name))
    monkeypatch.setattr(PackagedGguf, "locate", lambda self: src)
    calls = []
    lock = threading.Lock()

    def counting_import(gguf_path, out_dir):
        with lock:
            calls.append(out_dir)
        return import_gguf(gguf_path, out_dir, progress=False)

    monkeypatch.setattr(source, "import_gguf", counting_import)
    return calls


def test_alias_is_imported_once_and_reused(tiny_alias, tmp_path):
    first = resolve_model("tiny", cache_dir=tmp_path)
    assert first == tmp_path.resolve() / "models" / "tiny"
    assert resolve_model("tiny", cache_dir=tmp_path) == first
    assert len(tiny_alias) == 1


def test_concurrent_resolves_import_once(tiny_alias, tmp_path):
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: resolve_model("tiny", cache_dir=tmp_path), range(4)))
    assert len(set(paths)) == 1 and len(tiny_alias) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny.lock", "tiny"]


def test_incomplete_or_outdated_cache_is_rebuilt(tiny_alias, tmp_path):
    dest = tmp_path / "models" / "tiny"
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # no marker: e.g. copied in by hand, half done
    (tmp_path / "models" / ".tiny.tmp-123-abc").mkdir()  # a crashed import's leftovers
    assert resolve_model("tiny", cache_dir=tmp_path) == dest.resolve()
    assert (dest / MARKER_FILE).exists() and not (tmp_path / "models" / ".tiny.tmp-123-abc").exists()

    marker = json.loads((dest / MARKER_FILE).read_text())
    (dest / MARKER_FILE).write_text(json.dumps({**marker, "importer_version": -1}))
    resolve_model("tiny", cache_dir=tmp_path)
    assert len(tiny_alias) == 2


def test_default_cache_dir_reads_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert source.default_cache_dir() == tmp_path
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert source.default_cache_dir() == Path.home() / ".cache" / "tandem"


def test_smollm2_cache_folder_is_complete(smollm2_path):
    assert smollm2_path == resolve_model("smollm2-135m")
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    ) == (30, 576, 9, 3)
    assert (cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (64, 1536, 49152)
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 8192 and cfg["torch_dtype"] == "bfloat16"


# --- slow: SmolLM2 against transformers' own GGUF loader -------------------------------------

SMOLLM2 = source.KNOWN_MODELS["smollm2-135m"]


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf_loader(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM

    gguf_file = SMOLLM2.locate()
    ours = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-3)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_gguf_conversion(smollm2_path):
    from transformers import AutoTokenizer

    gguf_file = SMOLLM2.locate()
    ours = AutoTokenizer.from_pretrained(smollm2_path)
    ref = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    texts = [
        "The capital of France is",
        "  leading spaces, trailing  \n\n tabs\t and 12345 digits 3.14159",
        "Grüße aus Köln — 東京 🙂 naïve café",
        "def f(x):\n    return x ** 2  # comment",
        "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    ]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow
def test_smollm2_greedy_says_paris(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    ids = torch.tensor([tok.encode("The capital of France is")])
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
