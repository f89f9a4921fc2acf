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


def _hold(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


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
                at = self._text.find(THINK_BEGIN)
                if at < 0:
                    keep = _hold(self._text, THINK_BEGIN)
                    out.content += self._text[:len(self._text) - keep]
                    self._text = self._text[len(self._text) - keep:]
                    return out
                out.content += self._text[:at]
                self._text, self._state = self._text[at + len(THINK_BEGIN):], "reasoning"
            elif self._state == "reasoning":
                if self._fresh and self.name == "deepseek_r1":
                    stripped = self._text.lstrip()
                    if THINK_BEGIN.startswith(stripped) and len(stripped) < len(THINK_BEGIN):
                        return out                 # maybe a leading <think>: wait for more
                    if stripped.startswith(THINK_BEGIN):
                        self._text = stripped[len(THINK_BEGIN):]
                    self._fresh = False
                at = self._text.find(THINK_END)
                if at < 0:
                    keep = _hold(self._text, THINK_END)
                    out.reasoning += self._text[:len(self._text) - keep]
                    self._text = self._text[len(self._text) - keep:]
                    return out
                out.reasoning += self._text[:at]
                self._text, self._state, self._after_end = self._text[at + len(THINK_END):], "answer", True
            else:
                if self._after_end:
                    self._text = self._text.lstrip()
                    self._after_end = not self._text
                out.content += self._text
                self._text = ""
                return out

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
