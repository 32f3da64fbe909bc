"""gRPC server reflection under both names clients ask for: `grpc.reflection.v1` and `v1alpha`.

`grpcio-reflection` serves only `grpc.reflection.v1alpha.ServerReflection`; newer clients
(grpcurl, Postman, grpc-java's and grpc-go's tools) ask `grpc.reflection.v1` first. The two
protocols are one: `v1/reflection.proto` is `v1alpha/reflection.proto` with the package
renamed, field for field, so the same servicer answers both, through v1alpha's message classes
(the bytes on the wire are the same). `reflection.proto` for v1 is registered in the default
descriptor pool as a generated module would register it, so reflection describes itself under
either name. Which services are listed is the server's choice (`sitsd.api.server`).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
_V1_PACKAGE = "grpc.reflection.v1"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's `reflection.proto`, renamed to v1 (package, file name, every type reference)."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = _V1_FILE
    proto.package = _V1_PACKAGE
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{_V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # messages and enums; scalars have none
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    proto.options.Clear()  # v1alpha's deprecation and language options are not v1's
    return proto


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
    except KeyError:
        pool.Add(_v1_file_descriptor())


_register_v1_descriptor()


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on `server`, listing `service_names` and both of its own."""
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    servicer = reflection.aio.ReflectionServicer(names)
    handlers = {}
    for service in (V1_SERVICE, V1ALPHA_SERVICE):
        method = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
        handlers[service] = grpc.method_handlers_generic_handler(
            service, {"ServerReflectionInfo": method}
        )
    server.add_generic_rpc_handlers(tuple(handlers.values()))
