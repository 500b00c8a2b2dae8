/** The kakeya.v1 service, loaded at run time from the proto this package carries (proto/, copied from the
 * repository's proto at build time); src/gen/ holds the TypeScript types generated from the same file. */

import { loadPackageDefinition } from "@grpc/grpc-js";
import { loadSync, type Options } from "@grpc/proto-loader";
import { fileURLToPath } from "node:url";

import type { ProtoGrpcType } from "./gen/runtime.js";

export type { AppendTokensRequest } from "./gen/kakeya/v1/AppendTokensRequest.js";
export type { AppendTokensResponse__Output as AppendTokensResponse } from "./gen/kakeya/v1/AppendTokensResponse.js";
export type { CloseSessionResponse__Output as CloseSessionResponse } from "./gen/kakeya/v1/CloseSessionResponse.js";
export type { CreateSessionRequest } from "./gen/kakeya/v1/CreateSessionRequest.js";
export type { CreateSessionResponse__Output as CreateSessionResponse } from "./gen/kakeya/v1/CreateSessionResponse.js";
export type { ExportSessionResponse__Output as ExportSessionResponse } from "./gen/kakeya/v1/ExportSessionResponse.js";
export type { ImportSessionResponse__Output as ImportSessionResponse } from "./gen/kakeya/v1/ImportSessionResponse.js";
export type { GenerateDone__Output as GenerateDone } from "./gen/kakeya/v1/GenerateDone.js";
export type { GenerateRequest } from "./gen/kakeya/v1/GenerateRequest.js";
export type { GenerateResponse__Output as GenerateResponse } from "./gen/kakeya/v1/GenerateResponse.js";
export type { GenerateStats__Output as GenerateStats } from "./gen/kakeya/v1/GenerateStats.js";
export type { GetModelInfoResponse__Output as GetModelInfoResponse } from "./gen/kakeya/v1/GetModelInfoResponse.js";
export type { GetSessionInfoRequest } from "./gen/kakeya/v1/GetSessionInfoRequest.js";
export type {
  GetSessionInfoResponse__Output as GetSessionInfoResponse,
} from "./gen/kakeya/v1/GetSessionInfoResponse.js";
export type { KvPolicy as KvPolicyIn, KvPolicy__Output as KvPolicyOut } from "./gen/kakeya/v1/KvPolicy.js";
export type { RuntimeServiceClient } from "./gen/kakeya/v1/RuntimeService.js";
export type { Speculation as SpeculationIn } from "./gen/kakeya/v1/Speculation.js";
export type { SparseCounters__Output as SparseCounters } from "./gen/kakeya/v1/SparseCounters.js";
export type { SparseStats__Output as SparseStats } from "./gen/kakeya/v1/SparseStats.js";
export type { Struct, Struct__Output } from "./gen/google/protobuf/Struct.js";
export type { Value, Value__Output } from "./gen/google/protobuf/Value.js";

const PROTO_DIR = fileURLToPath(new URL("../../proto", import.meta.url)); // dist/src/ -> the package root
const PROTO_FILE = "kakeya/v1/runtime.proto";

// Must match the flags in scripts/generate.mjs: the generated types describe what this loader produces
// (64-bit integers as decimal strings, enums as their names, defaults filled in, oneofs named).
const LOADER_OPTIONS: Options = {
  keepCase: false, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [PROTO_DIR],
};

let proto: ProtoGrpcType | undefined;

/** The loaded package (parsed once per process). */
export function runtimeProto(): ProtoGrpcType {
  proto ??= loadPackageDefinition(loadSync(PROTO_FILE, LOADER_OPTIONS)) as unknown as ProtoGrpcType;
  return proto;
}
