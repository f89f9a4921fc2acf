"""Incremental detokenization and stop conditions (torch-free).

`IncrementalDetokenizer` turns a stream of token ids into a stream of text deltas that can be sent to
a client as they are, and cuts the text at stop strings. `StopChecker` decides when a request is
finished by token (EOS, stop_token_ids) or length. A request finishes when either one says so.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer.protocol import TokenizerLike

# Tokens of already-decoded text decoded again with every new token, so that decoders which depend
# on the left neighbour (SentencePiece's leading-space handling, merges across tokens) see it.
_CONTEXT_TOKENS = 5
# Byte-level decoders render an incomplete UTF-8 sequence at the end as this character.
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Token ids in, text deltas out, one request at a time.

    Guarantees: the concatenation of everything `append` and `flush` return is
    `tokenizer.decode(output_ids)` (for tokenizers whose decode concatenates, e.g. byte-level BPE,
    and a prompt that ends on a character boundary), cut before the first stop string; every
    intermediate concatenation is a prefix of that final text. In particular a delta never ends
    in half a character, and never contains a stop string.

    Cost per token is O(1) in the output length: only a window of recent tokens is decoded.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        assert all(self._stop), "empty stop string"
        # Only the tail of the prompt is ever decoded again; keep just that.
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        # _ids[_prefix:_read] has been emitted and serves as left context; _ids[_read:] has not.
        self._prefix = 0
        self._read = len(self._ids)
        self._held = ""  # text released by the decoder but held back as a possible stop-string start
        self._pieces: list[str] = []
        self.matched_stop: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._pieces)

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text that can now be sent (often "").

        After a stop string matched (`finished`), further tokens are ignored and "" is returned.
        """
        if self.finished:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        # A trailing U+FFFD is (usually) a character whose remaining bytes are still to come; the
        # window start stays put until it completes so its bytes are decoded together.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        self._compact()
        return self._release(delta, final=False)

    def flush(self) -> str:
        """Return all text still held back; call once when the request ends without a stop string.

        May end in U+FFFD if the output stops inside a character (the full decode does too).
        Returns "" if a stop string already matched.
        """
        if self.finished:
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return self._release(new_text[len(prefix_text) :], final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _compact(self) -> None:
        # Tokens before the window are never read again; drop them so memory stays bounded.
        if self._prefix > 4 * _CONTEXT_TOKENS:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _release(self, delta: str, final: bool) -> str:
        """Pass decoded text through the stop-string filter; return what may be emitted."""
        buf = self._held + delta
        self._held = ""
        if self._stop:
            cut = _first_stop(buf, self._stop)
            if cut is not None:
                start, stop = cut
                self.matched_stop = stop
                self.finished = True
                buf = buf[:start]
            elif not final:
                hold = _stop_prefix_len(buf, self._stop)
                if hold:
                    buf, self._held = buf[:-hold], buf[-hold:]
        if buf:
            self._pieces.append(buf)
        return buf


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The stop string that completes first in `text` (ties: the one starting first), with its start.

    "Completes first" is what token-by-token generation would hit, whatever the chunking of `text`.
    """
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), i, s)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[1], best[2])


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class StopChecker:
    """Token- and length-based finish conditions for one request.

    `check` is called after each generated token with the whole output so far. A token stop wins
    over LENGTH when both apply. `matched_stop_token` follows vLLM's `stop_reason`: None when the
    model's EOS ended the output (checked first, so an EOS id also listed in stop_token_ids still
    reads as EOS), the token id when a `stop_token_ids` entry did.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int]):
        self._max_tokens = params.max_tokens
        self._eos_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self.matched_stop_token: int | None = None

    def check(self, output_ids: Sequence[int]) -> FinishReason | None:
        """FinishReason if the request is done after its latest token, else None."""
        if not output_ids:
            return None
        last = output_ids[-1]
        if last in self._eos_ids:
            return FinishReason.STOP
        if last in self._stop_ids:
            self.matched_stop_token = last
            return FinishReason.STOP
        if len(output_ids) >= self._max_tokens:
            return FinishReason.LENGTH
        return None
