"""bf16 (the serving default) agrees with Hugging Face `transformers` in bf16.

Two bf16 forwards cannot agree token for token: they round at different places (Tandem keeps the
residual stream, norms, RoPE and the top logits in fp32; HF rounds each of them to bf16), and a
greedy choice between two tokens closer than bf16's resolution is decided by rounding noise. So
the rule checked here is: greedy outputs are identical up to the first position where the two
tokens are a tie as far as bf16 can tell — the fp32 model prefers HF's token over ours by at most
`LOGIT_RTOL` of the largest |logit| (the same band the first-step logits are held to) — and a
divergence anywhere else fails. That rule is the correctness check, the same on every CPU. How
often a 32-token path crosses a near-tie that the two implementations round differently depends on
the CPU's bf16 matmul kernels (oneDNN's AMX or AVX512-BF16 kernels, or the conversion through fp32
where bf16 is not native, which HF and Tandem then share), so the number of SmolLM2 prompts that
agree to the end has a floor per CPU class (`MIN_AGREE`): measured 8 of 10 on an Intel/AMX box, 5 on
an AMD Zen 4 (AVX512-BF16; with and without the fused CPU kernels), 5 on the same Zen 4 capped to
AVX2 (`make test-avx2`), 3 on a real AVX2-only EPYC; each floor sits below its class's lowest
measurement, so a change that sent near-ties the other way systematically still fails. (The tiny
random models, whose logits are nearly flat, tie far more often and are held to the tie rule alone.)
Outputs stop at EOS on both sides (HF's `min_new_tokens` would suppress EOS, which is not what the
server does).

And Tandem's bf16 is at least as faithful to fp32 as HF's: teacher-forced on the fp32 model's
own continuations, its greedy token agrees with fp32's at least as often as HF's bf16 does
(measured: Tandem 99.6%, HF 97.7% over 14 prompts x 40 tokens). Positions where fp32's top two
logits are closer than one bf16 step at the top logit's magnitude are ties and not counted: which
side of such a tie a bf16 forward lands on is rounding noise (measured on the 10 prompts here: every
miss of either side, 4 of ours and 3 of HF's, was such a tie, gaps 0.005-0.12 at |logit| ~23,
where bf16's step is 0.125), and counting them made the comparison a coin flip (237 against 237).

First-step logits are compared directly: `|Tandem - HF|` max over the vocabulary stays within
`LOGIT_RTOL` of the largest |logit| (bf16 keeps ~3 significant digits; measured: SmolLM2's logits
of ~25 move by up to 0.75 over 30 layers). The tiny random models get `TINY_LOGIT_RTOL`: their
random q/k/v biases (std 0.5) amplify rounding (measured up to 0.61 of 12.25, 5%).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.hardware import detect
from tandem.engine.sampling_params import SamplingParams
from tests.engine.test_engine_vs_hf import random_prompts

SMOLLM2_TOKENS = 32
# Of the 10 SmolLM2 prompts, how many must agree with HF's bf16 to the end, by whether this CPU
# multiplies bf16 natively (see the module docstring for the measurements behind them).
MIN_AGREE = {True: 4, False: 2}
LOGIT_RTOL = 0.04
TINY_LOGIT_RTOL = 0.07

COMPLETIONS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at",
    "The largest planet in the solar system is",
]
CHATS = [
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Who wrote Hamlet?",
]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def hf_greedy_until_eos(hf, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                      eos_token_id=sorted(eos))
    return out[0, len(prompt):].tolist()


def check_same_until_tie(hf32, prompt: list[int], ours: list[int], ref: list[int],
                         rtol: float = LOGIT_RTOL) -> int | None:
    """Assert `ours` == `ref` up to a bf16 tie (judged by the fp32 model `hf32`); returns the
    index where they part (None: equal)."""
    n = min(len(ours), len(ref))
    div = next((i for i in range(n) if ours[i] != ref[i]), None)
    if div is None:
        assert len(ours) == len(ref), (ours, ref)
        return None
    lg = hf_logits(hf32, prompt + ref[:div])
    gap = float(lg[ref[div]] - lg[ours[div]])
    assert gap <= rtol * lg.abs().max().item(), (
        f"diverged at token {div} where fp32 clearly prefers HF's token (gap {gap:.3f}): ours "
        f"{ours[div]} vs HF {ref[div]}")
    return div


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = LOGIT_RTOL) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= rtol * ref.abs().max().item(), f"max |logit diff| {diff:.3f}"


def engine_first_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    return _capture_logits(engine, prompt, every_position=False)[0]


def engine_all_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids` in one prefill (prefix cache bypassed)."""
    return _capture_logits(engine, ids, every_position=True)


def _capture_logits(engine: LLMEngine, prompt: list[int], every_position: bool) -> torch.Tensor:
    captured = []
    model = engine.runner.model
    forward = model.forward

    def capture(ctx):
        if every_position:
            assert ctx.num_tokens == len(prompt), "prefix cache hit: use a fresh prompt"
            ctx.logits_indices = torch.arange(ctx.num_tokens)
        out = forward(ctx)
        captured.append(out.clone())
        return out[-1:] if every_position else out

    model.forward = capture
    try:
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    finally:
        model.forward = forward
    return captured[0]


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_path):
    engine = LLMEngine(EngineConfig(model=str(smollm2_path), dtype="bfloat16", max_total_tokens=8192,
                                    enable_prefix_cache=False))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return engine, hf, hf32


def smollm2_prompts(engine: LLMEngine) -> list[list[int]]:
    tok = engine.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    return [tok.encode(p) for p in COMPLETIONS + chats]


def test_smollm2_greedy_agrees_with_hf_bf16(smollm2_bf16):
    engine, hf, hf32 = smollm2_bf16
    prompts = smollm2_prompts(engine)
    results = engine.generate(prompts, SamplingParams(max_tokens=SMOLLM2_TOKENS, temperature=0))
    ties = []
    for prompt, res in zip(prompts, results, strict=True):
        ref = hf_greedy_until_eos(hf, prompt, SMOLLM2_TOKENS, set(engine.eos_token_ids))
        ties.append(check_same_until_tie(hf32, prompt, res.token_ids, ref))
    assert sum(t is None for t in ties) >= MIN_AGREE[detect("cpu").native_bf16], ties
    engine.check_idle()


def test_smollm2_first_step_logits_close_to_hf_bf16(smollm2_bf16):
    engine, hf, _ = smollm2_bf16
    for prompt in smollm2_prompts(engine)[::3]:
        assert_logits_close(engine_first_logits(engine, prompt), hf_logits(hf, prompt))


# 2-3 min on 2 cores, three quarters of it Hugging Face's fp32 `generate` of the 10 reference
# continuations: `make test-slow` (CI runs it). The greedy, first-step-logits and France tests stay in
# `make test`.
@pytest.mark.slow
def test_smollm2_bf16_at_least_as_faithful_to_fp32_as_hf(smollm2_bf16, smollm2_path):
    engine, hf, hf32 = smollm2_bf16
    prompts = smollm2_prompts(engine)
    ours_agree = hf_agree = all_agree = total = 0
    for prompt in prompts:
        ref = hf32.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                            pad_token_id=0)[0].tolist()
        with torch.no_grad():
            fp32_logits = hf32(torch.tensor([ref])).logits[0, len(prompt) - 1:-1]
            hf_top = hf(torch.tensor([ref])).logits[0, len(prompt) - 1:-1].argmax(-1)
        fp32_top = fp32_logits.argmax(-1)
        ours_top = engine_all_logits(engine, ref)[len(prompt) - 1:-1].argmax(-1)
        all_agree += int((ours_top == fp32_top).sum())
        clear = ~bf16_ties(fp32_logits)
        ours_agree += int((ours_top == fp32_top)[clear].sum())
        hf_agree += int((hf_top == fp32_top)[clear].sum())
        total += len(fp32_top)
    assert ours_agree >= hf_agree, (ours_agree, hf_agree, total)
    assert all_agree >= 0.97 * total, (all_agree, total)


def bf16_ties(logits: torch.Tensor) -> torch.Tensor:
    """[positions] bool: fp32's top two logits are closer than bf16's spacing at the top logit."""
    top2 = logits.topk(2, dim=-1).values
    step = torch.exp2(torch.floor(torch.log2(top2[:, 0].abs())) - 7)   # bf16 keeps 8 significant bits
    return (top2[:, 0] - top2[:, 1]) < step


def test_smollm2_answers_france_in_bf16(smollm2_bf16):
    engine = smollm2_bf16[0]
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    [res] = engine.generate([chat], SamplingParams(max_tokens=24, temperature=0))
    assert res.text.startswith("The capital of France is Paris"), res.text


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_tiny_models_agree_with_hf_bf16(arch, request):
    path = request.getfixturevalue(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", page_size=4, max_total_tokens=2048))
    prompts = random_prompts([1, 7, 33, 12], engine.model_config.vocab_size, seed=3)
    results = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
        check_same_until_tie(hf32, prompt, res.token_ids, ref, TINY_LOGIT_RTOL)
        ours, ref_logits = engine_first_logits(engine, prompt), hf_logits(hf, prompt)
        assert_logits_close(ours, ref_logits, TINY_LOGIT_RTOL)
    engine.check_idle()
