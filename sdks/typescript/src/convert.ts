/** protobuf (generated) <-> SDK plain objects, plus client-side argument checks. */

import { InvalidArgument } from "./errors.js";
import type * as pb from "./rpc.js";
import type {
  FinishReason, GenerateResult, GenerateStats, KvPolicy, ModelInfo, SessionInfo, SparseCounters, SparseStats,
  Speculation,
} from "./types.js";

const INT32_MIN = -(2 ** 31);
const INT32_MAX = 2 ** 31 - 1;

export function tokenList(ids: Iterable<number>, what: string): number[] {
  if (ids == null || typeof (ids as Iterable<number>)[Symbol.iterator] !== "function") {
    throw new InvalidArgument(`${what} must be an iterable of integers`);
  }
  const out = Array.from(ids);
  for (const t of out) {
    if (typeof t !== "number" || !Number.isInteger(t)) {
      throw new InvalidArgument(`${what} must be integers, got ${String(t)}`);
    }
    if (t < INT32_MIN || t > INT32_MAX) throw new InvalidArgument(`${what}: token ids must fit in int32`);
  }
  return out;
}

/** What a value is, for an error message (never its contents). */
export function describe(v: unknown): string {
  if (v === null) return "null";
  if (Array.isArray(v)) return "an array";
  if (typeof v === "object") return (v as object).constructor?.name ?? "an object";
  return typeof v === "string" ? `the string ${JSON.stringify(v.slice(0, 40))}` : `${typeof v} ${String(v)}`;
}

function isPlainObject(v: unknown): v is Record<string, unknown> {
  if (v === null || typeof v !== "object") return false;
  const proto = Object.getPrototypeOf(v);
  return proto === Object.prototype || proto === null;
}

/** An options object whose keys are all known: a misspelt option (`maxtokens`) is refused, not silently ignored. */
export function checkOptions(o: unknown, known: readonly string[], what: string): void {
  if (o === undefined) return;
  if (!isPlainObject(o)) throw new InvalidArgument(`${what} options must be an object, got ${describe(o)}`);
  for (const k of Object.keys(o)) {
    if (!known.includes(k)) {
      throw new InvalidArgument(`${what}: unknown option ${JSON.stringify(k)} (known: ${known.join(", ")})`);
    }
  }
}

/** A boolean option: undefined or null is `fallback`; anything but true or false is refused (no truthiness). */
export function flag(value: unknown, what: string, fallback = false): boolean {
  if (value === undefined || value === null) return fallback;
  if (typeof value !== "boolean") throw new InvalidArgument(`${what} must be true or false, got ${describe(value)}`);
  return value;
}

/** undefined or null: the server's default policy; a name; or { name, params } with params a plain object. */
export function policyToPb(policy: KvPolicy | string | undefined | null): pb.KvPolicyIn | undefined {
  if (policy === undefined || policy === null) return undefined;
  const p: unknown = typeof policy === "string" ? { name: policy } : policy;
  if (!isPlainObject(p) || typeof p.name !== "string") {
    throw new InvalidArgument(`policy must be a KvPolicy ({ name, params }) or a policy name, got ${describe(policy)}`);
  }
  if (p.params != null && !isPlainObject(p.params)) {
    throw new InvalidArgument(`policy.params must be a plain object of JSON-like values, got ${describe(p.params)}`);
  }
  const params = p.params as Record<string, unknown> | null | undefined;
  return { name: p.name, params: params ? structToPb(params) : undefined };
}

/** undefined: unset (Generate: the session default; createSession: off); a string names the proposer. */
export function speculationToPb(s: Speculation | string | null | undefined): pb.SpeculationIn | undefined {
  if (s == null) return undefined; // null, like undefined, leaves it unset (as for every other option)
  if (typeof s !== "string" && !isPlainObject(s)) {
    throw new InvalidArgument(`speculation must be a proposer name or { proposer, maxDraftTokens }, got ${describe(s)}`);
  }
  const spec = typeof s === "string" ? { proposer: s } : s;
  const k = spec.maxDraftTokens ?? 0;
  if (typeof spec.proposer !== "string") throw new InvalidArgument("speculation.proposer must be a string");
  if (!Number.isInteger(k) || k < 0 || k > 2 ** 32 - 1) {
    throw new InvalidArgument(`speculation.maxDraftTokens must be a non-negative integer, got ${k}`);
  }
  return { proposer: spec.proposer, maxDraftTokens: k };
}

export function policyFromPb(p: pb.KvPolicyOut | null | undefined): KvPolicy {
  return { name: p?.name ?? "", params: p?.params ? structFromPb(p.params) : {} };
}

// google.protobuf.Struct <-> plain JSON-like objects (numbers are doubles on the wire).
function structToPb(obj: Record<string, unknown>): pb.Struct {
  return { fields: Object.fromEntries(Object.entries(obj).map(([k, v]) => [k, valueToPb(v, k)])) };
}

function valueToPb(v: unknown, where: string): pb.Value {
  if (v === null) return { nullValue: "NULL_VALUE" };
  if (typeof v === "number") return { numberValue: v };
  if (typeof v === "string") return { stringValue: v };
  if (typeof v === "boolean") return { boolValue: v };
  if (Array.isArray(v)) return { listValue: { values: v.map((x) => valueToPb(x, where)) } };
  if (isPlainObject(v)) return { structValue: structToPb(v) };
  throw new InvalidArgument(`policy params must be JSON-like: ${where} is ${describe(v)}`);
}

function structFromPb(s: pb.Struct__Output): Record<string, unknown> {
  return Object.fromEntries(Object.entries(s.fields ?? {}).map(([k, v]) => [k, valueFromPb(v)]));
}

function valueFromPb(v: pb.Value__Output): unknown {
  switch (v.kind) {
    case "numberValue": return v.numberValue;
    case "stringValue": return v.stringValue;
    case "boolValue": return v.boolValue;
    case "structValue": return v.structValue ? structFromPb(v.structValue) : {};
    case "listValue": return (v.listValue?.values ?? []).map(valueFromPb);
    default: return null;
  }
}

export interface GenerateOptions {
  /** Upper bound on generated tokens (default 256). */
  maxTokens?: number;
  /** Makes sampling reproducible; in [0, 2**63). */
  seed?: number | bigint;
  /** 0 (the default) is greedy; otherwise in (0, 100]. Below 1e-4 decodes greedily too. */
  temperature?: number;
  /** 0 (the default) keeps the whole vocabulary. */
  topK?: number;
  /** Nucleus mass in (0, 1]. */
  topP?: number;
  /** Stop on these ids too (on top of the model's EOS ids unless ignoreEos). */
  stopTokens?: Iterable<number>;
  ignoreEos?: boolean;
  /**
   * Stop strings (at most 16, each 1 to 256 characters): generation ends right after the token whose text
   * completes one of them (finishReason "stop"; `result.stopString` says which). Nothing is trimmed: those tokens
   * are yielded and stay in the session history, which the next Generate continues from;
   * `textBeforeStop(tokenizer.decode(gen.tokenIds), gen.result)` is the text before the stop string.
   */
  stop?: string | Iterable<string>;
  /** Speculative decoding for this call ("history", "off" or a Speculation); absent: the session's default. */
  speculation?: Speculation | string;
  /** Aborting cancels the Generate; iterating then rejects with `signal.reason`. */
  signal?: AbortSignal;
}

const GENERATE_OPTIONS = ["maxTokens", "seed", "temperature", "topK", "topP", "stopTokens", "ignoreEos", "stop",
  "speculation", "signal"] as const;

export function generateRequest(sessionId: string, o: GenerateOptions): pb.GenerateRequest {
  checkOptions(o, GENERATE_OPTIONS, "generate");
  const maxTokens = o.maxTokens ?? 256;
  if (!Number.isInteger(maxTokens) || maxTokens < INT32_MIN || maxTokens > INT32_MAX) {
    throw new InvalidArgument(`bad generate parameters: maxTokens must be an int32, got ${maxTokens}`);
  }
  const topK = o.topK ?? 0;
  if (!Number.isInteger(topK) || topK < INT32_MIN || topK > INT32_MAX) {
    throw new InvalidArgument(`bad generate parameters: topK must be an int32, got ${topK}`);
  }
  const temperature = o.temperature ?? 0;
  if (typeof temperature !== "number") throw new InvalidArgument("bad generate parameters: temperature is a number");
  if (o.topP != null && typeof o.topP !== "number") {
    throw new InvalidArgument(`bad generate parameters: topP is a number, got ${describe(o.topP)}`);
  }
  let seed: bigint | undefined;
  if (o.seed != null) { // null, like undefined, leaves it unset (as for every other option)
    if (!(typeof o.seed === "bigint" || (typeof o.seed === "number" && Number.isSafeInteger(o.seed)))) {
      throw new InvalidArgument("bad generate parameters: seed must be a safe integer (a bigint above 2**53 - 1), " +
        `got ${describe(o.seed)}`);
    }
    seed = BigInt(o.seed);
    if (seed < 0n || seed >= 2n ** 64n) throw new InvalidArgument(`bad generate parameters: seed out of range`);
  }
  const given: unknown = o.stop ?? [];
  if (typeof given !== "string" && typeof (given as Iterable<unknown>)[Symbol.iterator] !== "function") {
    throw new InvalidArgument("bad generate parameters: stop must be a string or an iterable of strings");
  }
  const stop = typeof given === "string" ? [given] : [...(given as Iterable<string>)]; // one string is one stop
  if (!stop.every((s) => typeof s === "string")) {
    throw new InvalidArgument("bad generate parameters: stop must be a string or an iterable of strings");
  }
  return {
    sessionId,
    maxTokens,
    sampling: { temperature, topK, topP: o.topP ?? undefined, seed: seed?.toString() }, // uint64 as a decimal string
    stopTokenIds: tokenList(o.stopTokens ?? [], "stopTokens"),
    ignoreEos: flag(o.ignoreEos, "ignoreEos"),
    stop,
    speculation: speculationToPb(o.speculation),
  };
}

const FINISH: Record<string, FinishReason> = {
  FINISH_REASON_STOP: "stop",
  FINISH_REASON_LENGTH: "length",
  FINISH_REASON_CANCELLED: "cancelled",
};

export function statsFromPb(s: pb.GenerateStats | null | undefined): GenerateStats {
  return {
    prefillTokens: s?.prefillTokens ?? 0,
    prefillS: s?.prefillSeconds ?? 0,
    ttftS: s?.ttftSeconds ?? 0,
    decodeS: s?.decodeSeconds ?? 0,
    decodeTokens: s?.decodeTokens ?? 0,
    decodeTokensPerS: s?.decodeTokensPerSecond ?? 0,
    queueS: s?.queueSeconds ?? 0,
    resumeS: s?.resumeSeconds ?? 0,
    speculation: s?.speculationProposer ?? "",
    draftTokens: s?.draftTokens ?? 0,
    acceptedDraftTokens: s?.acceptedDraftTokens ?? 0,
    acceptanceRate: s?.acceptanceRate ?? 0,
    tokensPerVerifierStep: s?.tokensPerVerifierStep ?? 0,
    verifierSteps: s?.verifierSteps ?? 0,
    speculationPauses: s?.speculationPauses ?? 0,
  };
}

export function resultFromPb(done: pb.GenerateDone, tokenIds: number[]): GenerateResult {
  return {
    tokenIds: [...tokenIds],
    finishReason: FINISH[done.finishReason] ?? "unspecified",
    stats: statsFromPb(done.stats),
    historyLength: done.historyLength,
    stopString: done.stopString || null,
  };
}

function counters(c: pb.SparseCounters | null | undefined): SparseCounters {
  return {
    steps: Number(c?.steps ?? 0),
    queries: Number(c?.queries ?? 0),
    blocksScored: Number(c?.blocksScored ?? 0),
    blocksSelected: Number(c?.blocksSelected ?? 0),
    positionsAttended: Number(c?.positionsAttended ?? 0),
    positionsVisible: Number(c?.positionsVisible ?? 0),
  };
}

function sparseFromPb(s: pb.SparseStats): SparseStats {
  const total = counters(s.total);
  return {
    total,
    layers: s.layers.map(counters),
    hotBytes: Number(s.hotBytes),
    coldBytes: Number(s.coldBytes),
    indexBytes: Number(s.indexBytes),
    attendedFraction: total.positionsAttended / Math.max(1, total.positionsVisible),
  };
}

export function sessionInfoFromPb(r: pb.GetSessionInfoResponse, withHistory: boolean): SessionInfo {
  const inv = r.invariants;
  return {
    sessionId: r.sessionId,
    historyLength: r.historyLength,
    cachedLength: r.cachedLength,
    kvLiveBytes: Number(r.kvLiveBytes),
    policy: policyFromPb(r.policy),
    inv1Checks: Number(inv?.inv1Checks ?? 0),
    inv2Checks: Number(inv?.inv2Checks ?? 0),
    inv1Violations: Number(inv?.inv1Violations ?? 0),
    inv2Violations: Number(inv?.inv2Violations ?? 0),
    generateCalls: r.generateCalls,
    idleS: r.idleSeconds,
    contextLength: r.contextLength,
    generating: r.generating,
    historyTokenIds: withHistory ? [...r.historyTokenIds] : null,
    policyLabel: r.policyLabel,
    kvResidentBytes: Number(r.kvResidentBytes),
    kvHistoryBytes: Number(r.kvHistoryBytes),
    effectiveAttentionFraction: r.effectiveAttentionFraction || 1.0, // unset (older servers): full
    kvCompressed: r.kvCompressed,
    idleCompressions: r.idleCompressions,
    sparse: r.sparse ? sparseFromPb(r.sparse) : null,
    speculation: r.speculation
      ? { proposer: r.speculation.proposer, maxDraftTokens: r.speculation.maxDraftTokens } : null,
    remaining: r.contextLength - r.historyLength,
  };
}

export function modelInfoFromPb(r: pb.GetModelInfoResponse): ModelInfo {
  return {
    modelName: r.modelName,
    modelType: r.modelType,
    vocabSize: r.vocabSize,
    eosTokenIds: [...r.eosTokenIds],
    bosTokenId: r.bosTokenId ?? null,
    contextLength: r.contextLength,
    tokenizerJson: r.tokenizerJson,
    chatTemplate: r.chatTemplate ?? null,
    maxSessions: r.maxSessions,
    maxConcurrent: r.maxConcurrent,
    sessionIdleTtlS: r.sessionIdleTtlSeconds,
    kvPolicies: [...r.kvPolicies],
    idleCompressAfterS: r.idleCompressAfterSeconds || null,
    idleCodec: r.idleCodec || null,
    weightFormat: r.weightFormat,
    weightFormatSource: r.weightFormatSource,
    compiledDecode: r.compiledDecode,
    fidelityKl: r.fidelityKl ?? null,
    fidelityTop1: r.fidelityTop1 ?? null,
    invariantNumerics: r.invariantNumerics,
    measuredDecodeTokS: r.measuredDecodeTokensPerSecond || null,
    maxSessionsPerKey: r.maxSessionsPerKey || null,
    kvBudgetBytes: Number(r.kvBudgetBytes) || null,
    kvBudgetPerKeyBytes: Number(r.kvBudgetPerKeyBytes) || null,
    runtimeVersion: r.runtimeVersion || null,
  };
}
