"""The standard gRPC health service (grpc.health.v1) and server reflection, so load balancers, probes and
`grpcurl` work without the .proto. Health answers without an API key (it tells only SERVING or
NOT_SERVING, see auth.OPEN_METHOD_PREFIXES); reflection, like every kakeya.v1 RPC, needs one when keys
are set."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


async def add_health_and_reflection(server: grpc.aio.Server, service_name: str) -> health.aio.HealthServicer:
    """Register both on `server`; the overall status ("") and `service_name` start SERVING."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    for name in ("", service_name):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer
