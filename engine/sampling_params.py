"""Per-request sampling parameters (torch-free).

One frozen dataclass that every layer shares: the gateway and the gRPC servicer build it from the
wire request, `validate()` rejects bad values at the edge, and the sampler and stop checker read it.

A request may leave the sampling fields a model can recommend (`MODEL_DEFAULT_FIELDS`) unset (None);
`SamplingDefaults.fill` gives them the model's values from its generation_config.json (as vLLM and
SGLang do), else OpenAI's (temperature 1, top_p 1). One rule for every API: the HTTP gateway, the gRPC
API and the SDK, `tandem generate` and the Python API. The engine fills every request it makes
(`LLMEngine.make_request`); the gateway fills with the same values from the same file (it reads the
effective temperature, e.g. to know a request is greedy). Greedy is asked for: temperature 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.engine.errors import InvalidRequest
from tandem.engine.structured_output import StructuredSpec

# The range torch.Generator.manual_seed accepts.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; beyond it the distribution is close to uniform noise
# What a model's generation_config.json may recommend and Tandem supports (vLLM reads these too).
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Turn the OpenAI `stop` field (null, one string, or a list of strings) into a tuple."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    top_k <= 0 disables top-k (the OpenAI-style -1 and 0 both mean "off"). `stop` and
    `stop_token_ids` may be given as any sequence (or `stop` as one string); they are stored as
    tuples so the object stays hashable. Call `validate()` before using a request's parameters.
    None in a `MODEL_DEFAULT_FIELDS` field: unset, the model's default (`SamplingDefaults.fill`).
    """

    max_tokens: int = 16
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # Constrained decoding (engine/structured/): every token keeps the output a prefix of this
    # language; None: free text. Checked where it is compiled: the router's validation and
    # LLMEngine.make_request (engine/structured/compile.py), so a bad one fails at the edge.
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        # A bare string would otherwise be iterated as single-character stop strings.
        object.__setattr__(self, "stop", normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> None:
        """Raise InvalidRequest (with `param` set to the offending field) if any value is out of range.
        Unset (None) fields pass: the defaults that fill them are checked where they are loaded."""
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _check_model_defaults(self)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-2 <= value <= 2):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value}", name)
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequest(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", "top_logprobs"
            )
        if self.seed is not None and not (_SEED_MIN <= self.seed <= _SEED_MAX):
            raise InvalidRequest(f"seed must fit in 64 bits, got {self.seed}", "seed")
        for s in self.stop:
            if not isinstance(s, str):
                raise InvalidRequest(f"stop must be strings, got {s!r}", "stop")
            if not s:
                raise InvalidRequest("stop strings must not be empty", "stop")
        for t in self.stop_token_ids:
            if t < 0:
                raise InvalidRequest(f"stop_token_ids must be >= 0, got {t}", "stop_token_ids")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the arg-max of the (penalized) logits."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        """True when any repetition / frequency / presence penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def wants_logprobs(self) -> bool:
        """True when the response carries the chosen token's logprob (asking for top_logprobs implies it)."""
        return self.logprobs or self.top_logprobs > 0


def _check_model_defaults(p: SamplingParams | SamplingDefaults) -> None:
    """Range checks of the fields a model may recommend; None (unset) passes."""
    t, top_p, top_k, min_p, rep = (getattr(p, f) for f in MODEL_DEFAULT_FIELDS)
    if t is not None and not (0 <= t <= MAX_TEMPERATURE):   # NaN fails both comparisons
        raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}", "temperature")
    if top_p is not None and not (0 < top_p <= 1):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if top_k is not None and top_k < -1:
        raise InvalidRequest(f"top_k must be -1 or 0 (disabled) or a positive integer, got {top_k}", "top_k")
    if min_p is not None and not (0 <= min_p <= 1):
        raise InvalidRequest(f"min_p must be in [0, 1], got {min_p}", "min_p")
    if rep is not None and not (rep > 0 and math.isfinite(rep)):
        raise InvalidRequest(f"repetition_penalty must be a finite number > 0, got {rep}", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request's unset (None) sampling fields become, on every API: the class defaults are
    OpenAI's (temperature 1: sampling, not greedy), `with_model` lays a model's recommendations over
    them; a request's own values always win."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    from_model: tuple[str, ...] = ()   # the fields whose value the model's generation_config.json set

    def __post_init__(self) -> None:
        _check_model_defaults(self)

    def with_model(self, recommended: Mapping[str, float | int]) -> SamplingDefaults:
        """These defaults with a model's recommendations over them. Raises InvalidRequest for a value
        a request could not carry either (engine/models/config.py leaves those out)."""
        unknown = set(recommended) - set(MODEL_DEFAULT_FIELDS)
        assert not unknown, f"not a field a model may recommend: {sorted(unknown)}"
        return dataclasses.replace(self, **recommended, from_model=tuple(f for f in MODEL_DEFAULT_FIELDS
                                                                         if f in recommended))

    def fill(self, params: SamplingParams) -> SamplingParams:
        """`params` with every unset field given its default (the same object when none is unset)."""
        unset = {f: getattr(self, f) for f in MODEL_DEFAULT_FIELDS if getattr(params, f) is None}
        return dataclasses.replace(params, **unset) if unset else params

    def describe(self) -> str:
        """One line for the start-up log: the values, and which of them the model chose."""
        values = ", ".join(f"{f} {getattr(self, f):g}" for f in MODEL_DEFAULT_FIELDS)
        if not self.from_model:
            return f"{values} (the model's generation_config.json recommends none)"
        return f"{values} ({', '.join(self.from_model)} from the model's generation_config.json)"

