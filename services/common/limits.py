"""Request size limits that the gateway and the router enforce before any worker is involved.

Each limit is one flag with the same name on the gateway, the router and `tandem up` (TGI's names
where it has one: --max-input-tokens, --max-stop-sequences); 0 turns a token limit off (the model's
context length, which workers check, still bounds it). A request over a limit gets a clear error
naming the parameter: HTTP 400 / gRPC INVALID_ARGUMENT, or 413 / RESOURCE_EXHAUSTED for a body or
message over --max-request-bytes. Torch-free.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.errors import InvalidRequest
from tandem.services.common.arg_groups import LIMITS
from tandem.services.common.flags import Flag, Owner

_OWNERS = Owner.ROUTER | Owner.GATEWAY


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = 8 << 20     # HTTP body (gateway) / gRPC message (router)
    max_input_tokens: int = 0            # prompt tokens; 0: only the context length bounds them
    max_output_tokens: int = 0           # max_tokens; 0: only the context length bounds it
    max_stop_sequences: int = 16         # stop strings per request
    max_stop_length: int = 512           # characters of one stop string

    def validate(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        for flag, value in (("--max-input-tokens", self.max_input_tokens),
                            ("--max-output-tokens", self.max_output_tokens),
                            ("--max-stop-sequences", self.max_stop_sequences),
                            ("--max-stop-length", self.max_stop_length)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestLimits:
        limits = cls(max_request_bytes=args.max_request_bytes, max_input_tokens=args.max_input_tokens,
                     max_output_tokens=args.max_output_tokens, max_stop_sequences=args.max_stop_sequences,
                     max_stop_length=args.max_stop_length)
        limits.validate()
        return limits

    def check_prompt_tokens(self, n: int, param: str = "prompt") -> None:
        if self.max_input_tokens and n > self.max_input_tokens:
            raise InvalidRequest(f"the prompt has {n} tokens; this server accepts at most {self.max_input_tokens} "
                                 f"(--max-input-tokens)", param)

    def check_max_tokens(self, value: int | None, param: str = "max_tokens") -> None:
        if self.max_output_tokens and value is not None and value > self.max_output_tokens:
            raise InvalidRequest(f"{param} is {value}; this server allows at most {self.max_output_tokens} "
                                 f"(--max-output-tokens)", param)

    def check_stop(self, stop: str | Sequence[str] | None, param: str = "stop") -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stops) > self.max_stop_sequences:
            raise InvalidRequest(f"{len(stops)} stop sequences; at most {self.max_stop_sequences} are allowed "
                                 f"(--max-stop-sequences)", param)
        for i, s in enumerate(stops):
            if len(s) > self.max_stop_length:
                raise InvalidRequest(f"stop sequence {i} has {len(s)} characters; at most {self.max_stop_length} "
                                     f"are allowed (--max-stop-length)", param)


# The gateway and the router enforce them; `tandem up` gives both what the user set.
LIMIT_FLAGS = (
    Flag(("--max-request-bytes",), _OWNERS, LIMITS,
         "largest request: HTTP body on the gateway (413 beyond it), gRPC message on the router "
         "(RESOURCE_EXHAUSTED), like TGI's --payload-limit", field="limits.max_request_bytes", type=int,
         metavar="BYTES"),
    Flag(("--max-input-tokens",), _OWNERS, LIMITS,
         "most prompt tokens a request may have (HTTP 400 / INVALID_ARGUMENT beyond it; the router counts "
         "token-id prompts, text is counted by the gateway and the workers); 0: only the model's context length "
         "bounds them", field="limits.max_input_tokens", type=int),
    Flag(("--max-output-tokens",), _OWNERS, LIMITS,
         "the largest max_tokens a request may ask for (400 beyond it); 0: only the context length bounds it",
         field="limits.max_output_tokens", type=int),
    Flag(("--max-stop-sequences",), _OWNERS, LIMITS, "most stop strings per request (400 beyond it)",
         field="limits.max_stop_sequences", type=int),
    Flag(("--max-stop-length",), _OWNERS, LIMITS, "most characters in one stop string (400 beyond it)",
         field="limits.max_stop_length", type=int),
)
