import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker

EOS = "<eos>"
WORDS = (
    "the quick brown fox jumps over lazy dog hello world serving tokens stream decode prefill "
    "café naïve résumé déjà vu über straße façade smörgåsbord "
    "你好 世界 日本語 한국어 数据 模型 "
    "😀 🚀 👍🏽 🇫🇷 € £ ¥ → ∑ ½"
).split()


class BpeAdapter:
    """TokenizerLike over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eos_token_ids = frozenset({tok.token_to_id(EOS)})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(i) for i in ids]


def _train_tokenizer() -> BpeAdapter:
    rng = random.Random(0)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return BpeAdapter(tok)


TOKENIZER = _train_tokenizer()
EOS_ID = next(iter(TOKENIZER.eos_token_ids))
PROMPTS = ["", "User: say something\nAssistant:", "naïve 你好 😀"]


def run(ids, prompt="", stop=(), skip_special_tokens=True):
    """Feed ids one by one; return (deltas, flushed text, detokenizer)."""
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode(prompt), skip_special_tokens, stop)
    deltas = []
    for t in ids:
        deltas.append(detok.append(t))
    return deltas, detok.flush(), detok


def test_tokenizer_splits_characters_across_tokens():
    # The test is only meaningful if some tokens carry part of a character.
    pieces = [TOKENIZER.decode([i]) for i in range(TOKENIZER.vocab_size)]
    assert any(p.endswith("\ufffd") for p in pieces)


@settings(max_examples=100, deadline=None)
@given(
    ids=st.lists(st.integers(0, TOKENIZER.vocab_size - 1), max_size=40),
    prompt=st.sampled_from(PROMPTS),
    skip_special_tokens=st.booleans(),
)
def test_deltas_concatenate_to_full_decode(ids, prompt, skip_special_tokens):
    deltas, tail, detok = run(ids, prompt, skip_special_tokens=skip_special_tokens)
    full = TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + tail == full
    assert detok.text == full
    emitted = ""
    for d in deltas:
        emitted += d
        # Never half a character: everything sent so far stays a prefix of the final text ...
        assert full.startswith(emitted)
        # ... and a delta never ends in the replacement char a partial character decodes to.
        assert not d.endswith("\ufffd")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_multilingual_text_round_trips(prompt):
    rng = random.Random(1)
    for _ in range(20):
        text = " ".join(rng.choices(WORDS, k=15))
        ids = TOKENIZER.encode(text)
        deltas, tail, _ = run(ids, prompt)
        assert "".join(deltas) == text and tail == ""
        assert all(not d.endswith("\ufffd") for d in deltas)


def test_emoji_is_held_until_complete():
    ids = TOKENIZER.encode("🚀")
    assert len(ids) > 1
    deltas, tail, _ = run(ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🚀" and tail == ""


def test_truncated_character_is_flushed_as_decoded():
    ids = TOKENIZER.encode("ok 🚀")[:-1]
    deltas, tail, detok = run(ids)
    # The space may share a token with the rocket's first bytes; then it waits with them.
    assert "".join(deltas) in ("ok", "ok ")
    assert tail.endswith("\ufffd") and detok.text == TOKENIZER.decode(ids)


def test_special_tokens_skipped_or_kept():
    ids = TOKENIZER.encode("hello") + [EOS_ID]
    assert "".join(run(ids, skip_special_tokens=True)[0]) == "hello"
    assert "".join(run(ids, skip_special_tokens=False)[0]) == "hello" + EOS


def test_long_output_keeps_window_small():
    text = " ".join(random.Random(2).choices(WORDS, k=400))
    ids = TOKENIZER.encode(text)
    deltas, tail, detok = run(ids)
    assert "".join(deltas) + tail == text
    assert len(detok._ids) < 50  # O(1) state: old tokens are dropped


# ---- stop strings ----


def reference_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """What token-by-token generation gives: cut at the stop string that completes first."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            longest = max(hits, key=len)
            return text[: end - len(longest)], longest
    return text, None


def test_stop_string_spanning_tokens_is_cut():
    text = "hello world. the quick brown fox"
    stop = "d. the qu"
    ids = TOKENIZER.encode(text)
    deltas, tail, detok = run(ids, stop=[stop])
    assert "".join(deltas) == "hello worl" and tail == ""
    assert detok.finished and detok.matched_stop == stop and detok.text == "hello worl"


def test_partial_stop_is_held_then_released():
    text = "hello world. hello world!"
    ids = TOKENIZER.encode(text)
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=["world!"])
    snapshots = []  # (text decoded so far, text emitted so far)
    for i, t in enumerate(ids):
        detok.append(t)
        snapshots.append((TOKENIZER.decode(ids[: i + 1]), detok.text))
    # When the first "world" was complete it was held back (it could begin "world!") ...
    assert ("hello world", "hello ") in snapshots
    # ... and released once "." ruled the stop string out.
    assert any(emitted.startswith("hello world.") for _, emitted in snapshots)
    assert detok.text == "hello world. hello " and detok.matched_stop == "world!"
    assert detok.flush() == ""


def test_held_text_that_never_matches_is_flushed():
    ids = TOKENIZER.encode("the end is near")
    deltas, tail, detok = run(ids, stop=["nearby"])
    assert "".join(deltas) == "the end is " and tail == "near"
    assert not detok.finished and detok.matched_stop is None


def test_tokens_after_stop_are_ignored():
    ids = TOKENIZER.encode("abc STOP more text")
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=["STOP"])
    out = "".join(detok.append(t) for t in ids)
    assert out == "abc " and detok.finished and detok.append(ids[0]) == ""


def test_stop_completed_by_flush():
    ids = TOKENIZER.encode("x🚀")  # the rocket's last token arrives; nothing after it
    deltas, tail, detok = run(ids, stop=["🚀"])
    assert "".join(deltas) + tail == "x" and detok.matched_stop == "🚀"


@settings(max_examples=100, deadline=None)
@given(
    words=st.lists(st.sampled_from(WORDS + ["a", "ab", "b"]), max_size=20),
    stops=st.lists(st.text(alphabet="ab é你😀", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_match_reference(words, stops):
    text = " ".join(words)
    expected, matched = reference_stop(text, stops)
    deltas, tail, detok = run(TOKENIZER.encode(text), stop=stops)
    got = "".join(deltas) + tail
    assert got == expected and detok.matched_stop == matched
    for i in range(len(deltas)):
        assert not any(s in "".join(deltas[: i + 1]) for s in stops)


class PiecesTokenizer:
    """Each id decodes to a fixed string: controls exactly what one step adds."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces
        self.vocab_size = len(pieces)
        self.eos_token_ids = frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.pieces[i] for i in ids]


def test_one_step_completing_two_stops_cuts_at_the_first_to_complete():
    # "bcd" completes both "bc" (ends first) and "abcd" (starts first); generation would have
    # stopped at "bc" had the text come one character at a time.
    detok = IncrementalDetokenizer(PiecesTokenizer(["a", "bcd"]), [], stop=["abcd", "bc"])
    assert detok.append(0) == "" and detok.append(1) == "a"
    assert detok.matched_stop == "bc"


# ---- StopChecker ----


def test_stop_checker_length():
    checker = StopChecker(SamplingParams(max_tokens=3), frozenset({EOS_ID}))
    assert checker.check([]) is None
    assert checker.check([5]) is None
    assert checker.check([5, 6]) is None
    assert checker.check([5, 6, 7]) is FinishReason.LENGTH
    assert checker.matched_stop_token is None


def test_stop_checker_eos_stops_without_a_matched_token():
    # vLLM's stop_reason: None when the model's EOS ended the output.
    checker = StopChecker(SamplingParams(), frozenset({EOS_ID, 99}))
    assert checker.check([5, 99]) is FinishReason.STOP
    assert checker.matched_stop_token is None
    assert StopChecker(SamplingParams(), frozenset({EOS_ID})).check([EOS_ID, 5]) is None


def test_stop_checker_eos_listed_in_stop_token_ids_still_reads_as_eos():
    checker = StopChecker(SamplingParams(stop_token_ids=(EOS_ID, 7)), frozenset({EOS_ID}))
    assert checker.check([5, EOS_ID]) is FinishReason.STOP and checker.matched_stop_token is None
    # With ignore_eos the id is only a stop token, and is reported as one.
    checker = StopChecker(SamplingParams(stop_token_ids=(EOS_ID,), ignore_eos=True), frozenset({EOS_ID}))
    assert checker.check([5, EOS_ID]) is FinishReason.STOP and checker.matched_stop_token == EOS_ID


def test_stop_checker_ignore_eos():
    checker = StopChecker(SamplingParams(ignore_eos=True, max_tokens=2), frozenset({EOS_ID}))
    assert checker.check([EOS_ID]) is None
    assert checker.check([EOS_ID, EOS_ID]) is FinishReason.LENGTH


def test_stop_checker_stop_token_ids():
    checker = StopChecker(SamplingParams(stop_token_ids=(7,), ignore_eos=True), frozenset({EOS_ID}))
    assert checker.check([1, 7]) is FinishReason.STOP and checker.matched_stop_token == 7


def test_stop_token_wins_over_length():
    checker = StopChecker(SamplingParams(max_tokens=2), frozenset({EOS_ID}))
    assert checker.check([1, EOS_ID]) is FinishReason.STOP


def test_finish_reason_values():
    assert [r.value for r in FinishReason] == ["length", "stop", "abort", "grammar_dead_end"]
