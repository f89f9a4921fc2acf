"""Reasoning output, the output side: a thinking model's `<think> ... </think>` split from its answer
(`--reasoning-parser`, vLLM's names), as `reasoning_content` beside `content` in chat. Torch-free.

Parsers (what the model writes):
- `qwen3`: `<think>` reasoning `</think>` answer. Text before `<think>` is answer; without `<think>`
  the whole output is answer (thinking off); an unclosed `<think>` is reasoning to the end.
- `deepseek_r1`: the chat template already opened the thinking (`<think>\\n` ends the prompt), so the
  output starts as reasoning (a leading `<think>` is dropped) until `</think>`; without it the whole
  output is reasoning (cut short while thinking).

One state machine for streaming and whole responses, as tool_parser.py: a whole response is one
`feed` and a `finish`, so a stream's deltas reassemble to exactly the non-streaming answer. While
streaming, text that may be the start of a tag is held back. The answer part is what tool calls are
read from (the tool parser runs on it). Whitespace right after `</think>` is not answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.services.gateway.tool_parser import _hold

THINK_BEGIN, THINK_END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser:
    """feed(text) → Split, …, finish() → Split."""

    def __init__(self, name: str):
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
        self.name = name
        # qwen3 starts in the answer (until <think>); deepseek_r1 in the reasoning (its prompt opened it).
        self._state = "reasoning" if name == "deepseek_r1" else "before"
        self._text = ""           # not emitted yet
        self._fresh = True        # nothing of the output read yet (deepseek_r1 drops a leading <think>)
        self._after_end = False   # whitespace right after </think> is dropped, however it arrives

    def feed(self, text: str) -> Split:
        out = Split()
        self._text += text
        while True:
            if self._state == "before":           # qwen3, until <think> (or its start) shows
                before, found = self._until(THINK_BEGIN)
                out.content += before
                if not found:
                    return out
                self._state = "reasoning"
            elif self._state == "reasoning":
                if self._fresh and self.name == "deepseek_r1":
                    stripped = self._text.lstrip()
                    if THINK_BEGIN.startswith(stripped) and len(stripped) < len(THINK_BEGIN):
                        return out                 # maybe a leading <think>: wait for more
                    if stripped.startswith(THINK_BEGIN):
                        self._text = stripped[len(THINK_BEGIN):]
                    self._fresh = False
                before, found = self._until(THINK_END)
                out.reasoning += before
                if not found:
                    return out
                self._state, self._after_end = "answer", True
            else:
                if self._after_end:
                    self._text = self._text.lstrip()
                    self._after_end = not self._text
                out.content += self._text
                self._text = ""
                return out

    def _until(self, marker: str) -> tuple[str, bool]:
        """The text before `marker` and whether it came (then the text after it stays); without it,
        all but an end that may be its start."""
        at = self._text.find(marker)
        if at < 0:
            at = len(self._text) - _hold(self._text, marker)
            before, self._text = self._text[:at], self._text[at:]
            return before, False
        before, self._text = self._text[:at], self._text[at + len(marker):]
        return before, True

    def finish(self) -> Split:
        """The text held back (a tag's start that never completed) goes where it stood."""
        out = Split()
        if self._state == "reasoning":
            out.reasoning += self._text
        else:
            out.content += self._text.lstrip() if self._after_end else self._text
        self._text = ""
        return out


def split_reasoning(name: str, text: str) -> Split:
    """A whole output → (reasoning, answer)."""
    p = ReasoningParser(name)
    out = p.feed(text)
    out += p.finish()
    return out
