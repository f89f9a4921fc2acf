"""A generic gRPC client, as grpcurl is: it knows no Tandem stub and learns the API from server reflection."""

from __future__ import annotations

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata to every call (grpcurl's -H)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self._metadata = metadata

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self._metadata))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def describe(addr: str, service: str, metadata: tuple[tuple[str, str], ...] = ()) -> tuple[list[str], list[str]]:
    """(the services `addr` lists, the methods of `service`), both learnt through reflection alone.
    Raises grpc.RpcError when the server refuses."""
    with grpc.insecure_channel(addr) as channel:
        db = ProtoReflectionDescriptorDatabase(grpc.intercept_channel(channel, _Metadata(metadata)))
        services = list(db.get_services())
        methods = [m.name for m in DescriptorPool(db).FindServiceByName(service).methods]
    return services, methods


def call_streaming(addr: str, service: str, method: str, request_json: dict,
                   metadata: tuple[tuple[str, str], ...] = ()) -> list[dict]:
    """Call a server-streaming method with a request written as JSON, its types learnt by reflection
    (what `grpcurl -d '{...}' addr service/method` does); the responses as JSON dicts."""
    with grpc.insecure_channel(addr) as channel:
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(grpc.intercept_channel(channel, _Metadata(metadata))))
        desc = pool.FindServiceByName(service).FindMethodByName(method)
        request_cls, response_cls = GetMessageClass(desc.input_type), GetMessageClass(desc.output_type)
        call = channel.unary_stream(f"/{service}/{method}", request_serializer=request_cls.SerializeToString,
                                    response_deserializer=response_cls.FromString)
        request = json_format.ParseDict(request_json, request_cls())
        return [json_format.MessageToDict(r) for r in call(request, metadata=metadata, timeout=60)]
