"""The tokenizer-bound half of constrained decoding (torch-free): one matcher per request, masks
written into a bitmask buffer, tokens consumed, drafts checked and rolled back.

    backend = GrammarBackend(tokenizer_json, eos_ids, vocab_size)   # once per worker (~0.3 s)
    g = backend.matcher(spec)        # InvalidRequest if spec cannot be enforced; cached prototypes
    g.fill(bitmask_row)              # the tokens legal next: bit t of int32 word t // 32
    g.consume([token])               # how many of the tokens the grammar took

A grammar reaches a *dead end* when it can neither go on nor end (no legal token; EOS is legal only
once the output is complete), or when it was handed a token it refuses: the engine then ends the
request with FinishReason.GRAMMAR_DEAD_END instead of passing a truncated value off as complete.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np

from tandem.engine.errors import InvalidRequest
from tandem.engine.structured.compile import compile_grammar
from tandem.engine.structured_output import StructuredSpec

log = logging.getLogger(__name__)

PROTOTYPES = 128     # compiled matchers kept per worker (a new request copies one: ~30 us)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RequestGrammar:
    """One request's matcher. Not thread-safe: the engine touches it from one thread at a time
    (the scheduling thread, or the mask thread while the scheduling thread waits for the step)."""

    def __init__(self, matcher: llguidance.LLMatcher, spec: StructuredSpec):
        self._m = matcher
        self.spec = spec
        self.num_tokens = 0            # tokens consumed (== the request's output tokens)
        self.refused = False           # was handed a token it does not accept
        self.ended = False             # ... after a complete value: complete, not dead

    def fill(self, row: np.ndarray) -> bool:
        """Write the next token's mask into `row` (int32 words); False at a dead end (no legal
        token; llguidance finds out only here, when the mask is computed)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return bool(row.any()) and not self.dead

    def consume(self, tokens: Sequence[int]) -> int:
        """Advance over `tokens`; returns how many it took (fewer: it refused the next one and is
        dead from then on, or the value was complete before them: `complete`, not dead)."""
        n = len(tokens)
        for i, t in enumerate(tokens):
            was_complete = self.complete
            if not self._m.consume_token(t):   # leaves the matcher in its error state
                n = i
                if was_complete:               # the value had ended (EOS may still follow): what
                    self.ended = True          # follows, drafts accepted past its end, is not output
                else:                          # and is no dead end
                    self.refused = True        # dead
                break
        self.num_tokens += n
        return n

    def accepts(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a draft) the grammar would take from here; changes nothing."""
        return self._m.validate_tokens(list(tokens)) if tokens else 0

    def rollback(self, n: int) -> None:
        if n:
            assert self._m.rollback(n), self._m.get_error()
            self.num_tokens -= n

    @property
    def complete(self) -> bool:
        """The output is a complete value and nothing may follow (the request ends here)."""
        return self.ended or (self._m.is_stopped() and self._m.is_accepting() and not self._m.is_error())

    @property
    def dead(self) -> bool:
        """No way to complete the value from here."""
        if self.ended:
            return False
        return self.refused or self._m.is_error() or (self._m.is_stopped() and not self._m.is_accepting())

    def error(self) -> str:
        return self._m.get_error()


_executor: llguidance.LLExecutor | None = None


def fill_rows(rows: Sequence[tuple[RequestGrammar, int]], bitmask: np.ndarray) -> None:
    """Masks of many matchers into their rows of `bitmask` in one call that holds the GIL once (a
    call per row would wait for the GIL per row while the forward pass runs Python between ops)."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"]
    _executor.unsafe_compute_mask_ptr([(g._m, i) for g, i in rows], bitmask.ctypes.data,
                                      bitmask.shape[1] * 4, bitmask.shape[0])


class GrammarBackend:
    """A worker's grammar compiler: the tokenizer in llguidance's form and an LRU of compiled
    matchers by the constraint's canonical key. Thread-safe."""

    def __init__(self, tokenizer_json: str | Path, eos_token_ids: Sequence[int], vocab_size: int,
                 compact: bool = True):
        """`compact`: JSON with no whitespace but the separators (else the model's own formatting, bounded)."""
        text = Path(tokenizer_json).read_text()
        self.compact = compact
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=self.eos_token_ids)
        self._protos: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredSpec) -> RequestGrammar:
        """A fresh matcher for `spec`. Raises InvalidRequest (see compile_grammar), or when the
        language admits no output at all with this vocabulary."""
        key = spec.key
        with self._lock:
            proto = self._protos.get(key)
            if proto is not None:
                self._protos.move_to_end(key)
        if proto is None:
            proto = llguidance.LLMatcher(self.tokenizer, compile_grammar(spec, self.compact), log_level=0)
            if proto.is_error():
                raise InvalidRequest(f"structured output: {proto.get_error().strip()}", "structured")
            first = np.frombuffer(proto.compute_bitmask(), dtype=np.uint8)   # llguidance finds a dead end here
            if not first.any() or (proto.is_stopped() and not proto.is_accepting()):
                raise InvalidRequest("structured output: the constraint admits no output", "structured")
            with self._lock:
                self._protos[key] = proto
                while len(self._protos) > PROTOTYPES:
                    self._protos.popitem(last=False)
        return RequestGrammar(proto.deep_copy(), spec)

    def words(self) -> int:
        return bitmask_words(self.vocab_size)
