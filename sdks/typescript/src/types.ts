/** Plain data returned by the client (no protobuf objects leak into user code). */

/** "stop": an EOS / stop token was generated (it is the last token and is in the history), or a stop string
 * completed; "length": maxTokens reached; "cancelled": the session was closed while generating. */
export type FinishReason = "stop" | "length" | "cancelled" | "unspecified";

/**
 * A per-session KV policy: a name plus parameters the server's cache factory takes.
 *
 * Server policies: "full" (every position kept), "sink_window" (sink + window positions, fixed memory),
 * "restore" (sink + window resident, evicted K/V recomputed so attention sees everything), "sparse" (an exact
 * hot window plus packed cold blocks, each query attending to the top-k blocks an indexer picks for it).
 * E.g. `{ name: "sink_window", params: { sink: 4, window: 1024 } }`. Responses carry normalised params.
 */
export interface KvPolicy {
  name: string;
  params?: Record<string, unknown>;
}

/**
 * Exact speculative decoding: a proposer drafts up to `maxDraftTokens` tokens per step and the model verifies them
 * in one forward. It changes speed, never what is generated (greedy output is identical; sampled output has the same
 * distribution). With "history" a seeded sampled stream is the one without speculation; with "self" and "draft_head"
 * (random drafts) it repeats with the same seed AND the same speculation setting.
 * Proposers: "history" (copies from the session's own history: fast when the model quotes or re-emits earlier
 * text), "self" (a layer-skipping draft from the served model itself), "draft_head" (an EAGLE-style head; untrained
 * unless the server has one: exact but slow), "off". `maxDraftTokens` in [1, 16]; 0 or absent: adaptive (history
 * drafts up to 15 tokens, more the longer its match; self and draft_head up to 4). The session's KV policy must be able to roll a draft back (full and restore can; sink_window and sparse need
 * spare >= maxDraftTokens and the identity codec), else InvalidArgument at createSession and FailedPrecondition for
 * one generate.
 */
export interface Speculation {
  proposer: string;
  maxDraftTokens?: number;
}

export interface GenerateStats {
  /** Only the history not yet cached: the incremental prefill. */
  prefillTokens: number;
  prefillS: number;
  ttftS: number;
  decodeS: number;
  decodeTokens: number;
  decodeTokensPerS: number;
  queueS: number;
  /** Decompressing an idle-compressed cache before the prefill (part of ttftS). */
  resumeS: number;
  /** The draft proposer used ("" when speculation was off). */
  speculation: string;
  /** Drafts the verifier checked, and how many it accepted. */
  draftTokens: number;
  acceptedDraftTokens: number;
  /** acceptedDraftTokens / draftTokens. */
  acceptanceRate: number;
  /** Tokens emitted per verifier forward (accepted drafts + 1). */
  tokensPerVerifierStep: number;
  verifierSteps: number;
  /** Times speculation paused because acceptance was too low to pay. */
  speculationPauses: number;
}

export interface GenerateResult {
  tokenIds: number[];
  finishReason: FinishReason;
  stats: GenerateStats;
  historyLength: number;
  /** The stop string (GenerateOptions.stop) that ended the generation; null when none did. */
  stopString: string | null;
}

/**
 * `text` (the generated tokens, decoded) cut before the stop string that ended the generation; unchanged when
 * none did. The tokens themselves (and the session history) keep the stop string.
 */
export function textBeforeStop(text: string, result: GenerateResult | undefined): string {
  const stop = result?.stopString;
  if (!stop) return text;
  const at = text.indexOf(stop);
  return at < 0 ? text : text.slice(0, at);
}

export interface SparseCounters {
  steps: number;
  queries: number;
  blocksScored: number;
  blocksSelected: number;
  positionsAttended: number;
  positionsVisible: number;
}

/** What the sparse policy did so far: counters (in total and per governed layer) and its memory split. */
export interface SparseStats {
  total: SparseCounters;
  layers: SparseCounters[];
  hotBytes: number;
  coldBytes: number;
  indexBytes: number;
  /** Keys attended over keys full attention would have read. */
  attendedFraction: number;
}

export interface SessionInfo {
  sessionId: string;
  historyLength: number;
  /** History tokens whose K/V are resident; the rest prefill at the next Generate. */
  cachedLength: number;
  kvLiveBytes: number;
  policy: KvPolicy;
  inv1Checks: number;
  inv2Checks: number;
  inv1Violations: number;
  inv2Violations: number;
  generateCalls: number;
  idleS: number;
  contextLength: number;
  generating: boolean;
  /** Only when asked for (`info({ includeHistory: true })`). */
  historyTokenIds: number[] | null;
  /** E.g. "sink_window(4+1024)". */
  policyLabel: string;
  kvResidentBytes: number;
  kvHistoryBytes: number;
  /** Share of the prefix the newest query attended to. */
  effectiveAttentionFraction: number;
  kvCompressed: boolean;
  idleCompressions: number;
  /** The sparse policy's counters and memory split (null under other policies). */
  sparse: SparseStats | null;
  /** The session's default speculation (null: off). */
  speculation: Speculation | null;
  /** Tokens the session can still take (appends plus maxTokens). */
  remaining: number;
}

export interface ModelInfo {
  modelName: string;
  modelType: string;
  vocabSize: number;
  eosTokenIds: number[];
  bosTokenId: number | null;
  contextLength: number;
  tokenizerJson: string;
  chatTemplate: string | null;
  maxSessions: number;
  maxConcurrent: number;
  sessionIdleTtlS: number;
  kvPolicies: string[];
  /** null: the server never compresses idle sessions. */
  idleCompressAfterS: number | null;
  /** The server's default idle codec, e.g. "d4/q38". */
  idleCodec: string | null;
  /** The served weight format (kakeya serve --weights): bf16, fp32, int8, int4 or int4-mixed ("" from older servers). */
  weightFormat: string;
  /** How it was chosen: "auto", "flag" or "as loaded". */
  weightFormatSource: string;
  /** Decode steps run a torch.compile'd step. */
  compiledDecode: boolean;
  /** Next-token KL vs bf16 on the bench text; null for bf16 itself or when not measured. */
  fidelityKl: number | null;
  /** Top-1 agreement with bf16 on the bench text; null for bf16 itself or when not measured. */
  fidelityTop1: number | null;
  /** INV-3: the served numerics are bit-exact whatever the step shapes. */
  invariantNumerics: boolean;
  /** Decode tokens/s measured at the server's start-up; null when not measured. */
  measuredDecodeTokS: number | null;
  /** Sessions one API key holds at once (every key has the same; maxSessions is the server's total): a new one
   * beyond it evicts that key's least recently used idle session. null from servers older than this field. */
  maxSessionsPerKey: number | null;
  /** KV bytes all sessions may reserve (each its policy's worst case at the context); null: not reported. */
  kvBudgetBytes: number | null;
  /** KV bytes one API key's sessions may reserve; null: not reported. */
  kvBudgetPerKeyBytes: number | null;
  /** The server's kakeya-runtime version; null from servers older than this field. */
  runtimeVersion: string | null;
}
