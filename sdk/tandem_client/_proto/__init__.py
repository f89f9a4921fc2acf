"""The generated protobuf module (built from proto/tandem/v1/generation.proto by sdk/gen_proto.py)."""

try:
    from tandem_client._proto import generation_pb2
except ImportError as e:  # a source checkout that was never built
    raise ImportError(
        "tandem_client's generated protobuf module is missing: install the SDK with `pip install ./sdk` "
        "or run `python sdk/gen_proto.py`"
    ) from e

__all__ = ["generation_pb2"]
