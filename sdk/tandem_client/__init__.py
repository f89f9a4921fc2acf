"""Tandem's gRPC client SDK (`pip install tandem-client`).

    from tandem_client import Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=16, temperature=0).text)
        for chunk in client.stream("Once upon a time", max_tokens=64):
            print(chunk.text, end="", flush=True)

`AsyncClient` is the asyncio twin. Failures raise the exceptions in `tandem_client.errors`.
"""

from tandem_client.aio import AsyncClient, AsyncStream
from tandem_client.client import Client, Stream
from tandem_client.errors import (
    AuthenticationError,
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestCancelledError,
    ResourceExhaustedError,
    ServerError,
    TandemError,
    UnavailableError,
)
from tandem_client.structured import (
    Choice,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    Tool,
    ToolCall,
    ToolCalls,
    parse_tool_calls,
)
from tandem_client.types import (
    NO_RETRY,
    FinishReason,
    GenerateResult,
    ModelInfo,
    RetryPolicy,
    SamplingParams,
    StreamChunk,
    TLSConfig,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "NO_RETRY", "AsyncClient", "AsyncStream", "AuthenticationError", "Choice", "Client", "DeadlineExceededError",
    "FinishReason", "GenerateResult", "Grammar", "InvalidRequestError", "JsonObject", "JsonSchema", "ModelInfo",
    "ModelNotFoundError", "Regex", "RequestCancelledError", "ResourceExhaustedError", "RetryPolicy", "SamplingParams",
    "ServerError", "Stream", "StreamChunk", "TLSConfig", "TandemError", "TokenLogprob", "Tool", "ToolCall",
    "ToolCalls", "TopLogprob", "UnavailableError", "Usage", "parse_tool_calls",
]
