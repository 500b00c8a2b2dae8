"""The standard health service (no key needed) and server reflection (key needed) on the gRPC port."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kakeya_runtime.server.testing import running_server, tiny_served

KEY = "health-test-key"
SERVICE = "kakeya.v1.RuntimeService"


@pytest.fixture(scope="module")
def keyed():
    with running_server(tiny_served("llama"), api_keys=(KEY,)) as thread:
        yield thread


def _reflect(channel: grpc.Channel, request: reflection_pb2.ServerReflectionRequest,
             metadata: tuple = ()) -> reflection_pb2.ServerReflectionResponse:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    return next(iter(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10)))


def test_health_answers_without_a_key(keyed):
    with grpc.insecure_channel(keyed.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_runtime_with_a_key(keyed):
    auth = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(keyed.address) as channel:
        with pytest.raises(grpc.RpcError) as e:  # the schema is not handed to callers without a key
            _reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = _reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""), auth)
        names = {s.name for s in listed.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
        described = _reflect(channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE), auth)
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in described.file_descriptor_response.file_descriptor_proto]
        methods = {m.name for f in files for s in f.service if s.name == "RuntimeService" for m in s.method}
        assert {"CreateSession", "AppendTokens", "Generate", "CloseSession", "GetModelInfo"} <= methods


def test_health_goes_not_serving_on_shutdown():
    with running_server(tiny_served("llama")) as thread:
        thread.call(thread.server.health.enter_graceful_shutdown())
        with grpc.insecure_channel(thread.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                                             timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
