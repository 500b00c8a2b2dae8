/** The SDK surface against a real runtime (the tiny random llama), the same scenarios as the Python SDK's tests. */

import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { Server, ServerCredentials, status } from "@grpc/grpc-js";

import {
  Client, DeadlineExceeded, FailedPrecondition, InvalidArgument, KakeyaError, ResourceExhausted, SessionNotFound,
  Unauthenticated, Unavailable,
} from "../src/index.js";
import { runtimeProto } from "../src/rpc.js";
import { startTinyServer, type RunningServer } from "./server.js";

const KEY = "test-key-alice-0001";
const OTHER_KEY = "test-key-bob-000002";

let server: RunningServer;
let client: Client;

before(async () => {
  // Every forward takes >= 10 ms, so a cancelled Generate stops visibly short of maxTokens.
  server = await startTinyServer({ apiKeys: [KEY, OTHER_KEY], stepDelayS: 0.01 });
  client = new Client(server.address, { apiKey: KEY });
});

after(async () => {
  client?.close();
  await server?.stop();
});

async function collect(iterable: AsyncIterable<number>): Promise<number[]> {
  const out: number[] = [];
  for await (const t of iterable) out.push(t);
  return out;
}

describe("client", () => {
  it("model info", async () => {
    const info = await client.modelInfo();
    assert.equal(info.modelName, "tiny-llama");
    assert.equal(info.modelType, "llama");
    assert.equal(info.vocabSize, 259);
    assert.deepEqual(info.eosTokenIds, [2]);
    assert.equal(info.bosTokenId, null);
    assert.equal(info.contextLength, 512);
    assert.ok(info.tokenizerJson.startsWith("{"));
    assert.ok(info.chatTemplate?.includes("<|im_start|>"));
    assert.deepEqual(info.kvPolicies, ["full", "sink_window", "restore", "sparse"]);
    assert.equal(info.idleCompressAfterS, null); // idle compression is off by default
    assert.equal(info.idleCodec, null);
    // An embedded test server serves its model as loaded (kakeya serve reports --weights/--compile's choice).
    assert.equal(info.weightFormat, "fp32");
    assert.equal(info.weightFormatSource, "as loaded");
    assert.equal(info.compiledDecode, false);
    assert.equal(info.fidelityKl, null);
    assert.equal(info.fidelityTop1, null);
    assert.equal(info.invariantNumerics, true);
    assert.equal(info.measuredDecodeTokS, null);
    assert.equal(info.maxSessions, 64);
    assert.equal(info.maxSessionsPerKey, 32); // two keys: an equal share each
    assert.ok(info.kvBudgetBytes !== null && info.kvBudgetBytes > 0);
    assert.equal(info.kvBudgetPerKeyBytes, Math.floor(info.kvBudgetBytes / 2));
    assert.match(info.runtimeVersion ?? "", /^\d+\.\d+\.\d+/);
    assert.equal(info.maxConcurrent, 8); // the server's default max batch
    assert.equal(info.sessionIdleTtlS, 1800);
    assert.equal(await client.modelInfo(), info); // cached
    assert.notEqual(await client.modelInfo({ refresh: true }), info);
  });

  it("session roundtrip and stats", async () => {
    const s = await client.createSession({ initialTokens: [10, 11, 12], policy: "full" });
    assert.match(s.id, /^ses_[A-Za-z0-9_-]{32,}$/); // >= 192 bits, url-safe
    assert.equal(s.historyLength, 3);
    assert.deepEqual(s.policy, { name: "full", params: {} });
    assert.equal(await s.append([13, 14]), 5);
    const gen = s.generate({ maxTokens: 6, ignoreEos: true });
    assert.equal(gen.result, undefined);
    assert.equal(gen.stats, undefined);
    const tokens = await collect(gen);
    assert.deepEqual(tokens, gen.tokenIds);
    assert.equal(tokens.length, 6);
    assert.equal(gen.finishReason, "length");
    const st = gen.stats!;
    assert.equal(st.prefillTokens, 5);
    assert.equal(st.decodeTokens, 6);
    assert.ok(st.prefillS > 0 && st.prefillS <= st.ttftS && st.decodeS > 0 && st.decodeTokensPerS > 0);
    assert.ok(st.queueS >= 0);
    assert.equal(gen.result!.historyLength, 11);
    assert.equal(s.historyLength, 11);
    assert.equal(s.lastResult, gen.result);
    const info = await s.info({ includeHistory: true });
    assert.deepEqual(info.historyTokenIds, [10, 11, 12, 13, 14, ...tokens]);
    assert.equal(info.cachedLength, 10);
    assert.ok(info.kvLiveBytes > 0);
    assert.equal(info.remaining, 512 - 11);
    assert.equal(info.generateCalls, 1);
    assert.equal(info.generating, false);
    assert.ok(info.idleS >= 0);
    assert.equal(info.inv1Violations + info.inv2Violations, 0);
    assert.ok(info.inv1Checks > 0);
    assert.equal((await s.info()).historyTokenIds, null);
    assert.throws(() => gen[Symbol.asyncIterator](), /once/);
    await s.close();
    await s.close(); // idempotent on this handle
    await assert.rejects(s.info(), SessionNotFound);
  });

  it("speculation: per call and session default, same greedy tokens, stats, typed refusals", async () => {
    const block = Array.from({ length: 24 }, (_, i) => 3 + ((i * 7) % 90));
    const history = [...block, 50, 51, 52, ...block.slice(0, 12)];
    const plain = await client.createSession({ initialTokens: history });
    const expected = await collect(plain.generate({ maxTokens: 40, ignoreEos: true }));
    await plain.close();
    const s = await client.createSession({ initialTokens: history, speculation: { proposer: "history", maxDraftTokens: 3 } });
    assert.deepEqual((await s.info()).speculation, { proposer: "history", maxDraftTokens: 3 });
    const gen = s.generate({ maxTokens: 40, ignoreEos: true });
    assert.deepEqual(await collect(gen), expected);
    const st = gen.stats!;
    assert.equal(st.speculation, "history");
    assert.ok(st.verifierSteps > 0 && st.draftTokens > 0 && st.draftTokens <= 3 * st.verifierSteps);
    assert.equal(st.acceptanceRate, st.acceptedDraftTokens / st.draftTokens);
    const off = s.generate({ maxTokens: 4, ignoreEos: true, speculation: "off" });
    await collect(off);
    assert.equal(off.stats!.speculation, "");
    assert.equal(off.stats!.draftTokens, 0);
    await assert.rejects(collect(s.generate({ maxTokens: 4, speculation: { proposer: "history", maxDraftTokens: 17 } })),
      InvalidArgument);
    await assert.rejects(collect(s.generate({ maxTokens: 4, speculation: "nope" })), InvalidArgument);
    await s.close();
    const ring = await client.createSession({ initialTokens: history, policy: { name: "sink_window", params: { window: 64 } } });
    await assert.rejects(collect(ring.generate({ maxTokens: 4, speculation: "history" })), FailedPrecondition);
    await ring.close();
  });

  it("a policy and its params travel as a Struct both ways", async () => {
    const s = await client.createSession({ initialTokens: [1, 2], policy: { name: "sink_window", params: { sink: 4, window: 64 } } });
    assert.equal(s.policy?.name, "sink_window");
    assert.equal(s.policy?.params?.sink, 4);
    assert.equal(s.policy?.params?.window, 64);
    const info = await s.info();
    assert.equal(info.policyLabel, "sink_window(4+64)");
    assert.deepEqual(info.policy, s.policy);
    await s.close();
    await assert.rejects(client.createSession({ policy: { name: "sink_window", params: { window: "wide" } } }),
      InvalidArgument);
    await assert.rejects(client.createSession({ policy: "no-such-policy" }), InvalidArgument);
  });

  it("stop tokens and EOS", async () => {
    const probeSession = await client.createSession({ initialTokens: [20, 21] });
    const probe = await probeSession.generate({ maxTokens: 4, ignoreEos: true }).collect();
    await probeSession.close();
    const stop = probe[2];
    const s = await client.createSession({ initialTokens: [20, 21] });
    const gen = s.generate({ maxTokens: 4, stopTokens: [stop], ignoreEos: true });
    const out = await gen.collect();
    assert.equal(gen.finishReason, "stop");
    assert.equal(out.at(-1), stop);
    assert.deepEqual(out, probe.slice(0, out.length));
    assert.ok(out.length <= 3);
    assert.equal((await s.info()).historyLength, 2 + out.length); // the stop token joined the history
    await s.close();
  });

  it("reattaches by id", async () => {
    const s = await client.createSession({ initialTokens: [1, 2] });
    const other = new Client(server.address, { apiKey: KEY });
    try {
      const again = other.session(s.id);
      assert.equal(await again.append([3]), 3);
      await again.close();
    } finally {
      other.close();
    }
    await assert.rejects(s.append([4]), SessionNotFound);
  });

  it("seeded sampling is reproducible and the seed matters", async () => {
    const runs: number[][] = [];
    for (const seed of [1, 1n, 2]) {
      const s = await client.createSession({ initialTokens: [30, 31, 32] });
      runs.push(await s.generate({ maxTokens: 10, temperature: 1.0, topK: 50, ignoreEos: true, seed }).collect());
      await s.close();
    }
    assert.deepEqual(runs[0], runs[1]);
    assert.notDeepEqual(runs[0], runs[2]);
  });

  it("typed errors carry gRPC codes", async () => {
    const bad = await client.createSession({ initialTokens: [10 ** 6] }).catch((e: unknown) => e);
    assert.ok(bad instanceof InvalidArgument && bad instanceof KakeyaError);
    assert.equal(bad.code, status.INVALID_ARGUMENT);
    const big = await client.createSession({ initialTokens: new Array(513).fill(1) }).catch((e: unknown) => e);
    assert.ok(big instanceof ResourceExhausted);
    assert.equal(big.code, status.RESOURCE_EXHAUSTED);
    const s = await client.createSession();
    await assert.rejects(s.generate({ maxTokens: 1 }).collect(), FailedPrecondition);
    await assert.rejects(s.append([]), InvalidArgument);
    await s.append([5]);
    await assert.rejects(s.generate({ maxTokens: 0 }).collect(), InvalidArgument);
    await s.close();
    await assert.rejects(client.session("ses_nope").append([1]), SessionNotFound);
    // Checked client-side, same class and code: ids that are not int32 integers.
    const local = await client.createSession({ initialTokens: [1.5] }).catch((e: unknown) => e);
    assert.ok(local instanceof InvalidArgument);
    assert.equal(local.code, status.INVALID_ARGUMENT);
    assert.equal(new KakeyaError("plain").code, undefined);
    assert.throws(() => client.session("x").generate({ seed: -1 }), InvalidArgument);
  });

  it("an export keeps the client-wide deadline", async () => {
    // A server whose export never answers: the client's timeoutMs bounds the call whole (it ran unbounded).
    const stalled = new Server();
    stalled.addService(runtimeProto().kakeya.v1.RuntimeService.service, { exportSession: () => {} });
    const port = await new Promise<number>((res, rej) =>
      stalled.bindAsync("127.0.0.1:0", ServerCredentials.createInsecure(), (e, p) => (e ? rej(e) : res(p))));
    const c = new Client(`127.0.0.1:${port}`, { timeoutMs: 300 });
    try {
      await assert.rejects(c.session("ses_any").export(), DeadlineExceeded);
    } finally {
      c.close();
      stalled.forceShutdown();
    }
  });

  it("an unreachable server is Unavailable", async () => {
    const c = new Client("127.0.0.1:1", { timeoutMs: 2000 });
    try {
      await assert.rejects(c.modelInfo(), Unavailable);
    } finally {
      c.close();
    }
  });
});

describe("cancellation", () => {
  it("leaving the loop early cancels the Generate", async () => {
    const s = await client.createSession({ initialTokens: [5, 6] });
    const gen = s.generate({ maxTokens: 200, ignoreEos: true });
    for await (const _ of gen) break;
    assert.equal(gen.result, undefined);
    assert.equal(gen.tokenIds.length, 1);
    await s.append([9]); // waits for the cancelled Generate to stop
    const info = await s.info();
    assert.equal(info.generating, false);
    assert.equal(info.cachedLength, info.historyLength - 2); // the last sampled token and the 9 are not cached
    assert.ok(info.historyLength < 2 + 200 + 1, `cancelled late: history ${info.historyLength}`);
    await s.close();
  });

  it("an AbortSignal stops a Generate and rejects with its reason", async () => {
    const s = await client.createSession({ initialTokens: [7, 8] });
    const controller = new AbortController();
    const gen = s.generate({ maxTokens: 200, ignoreEos: true, signal: controller.signal });
    const seen: number[] = [];
    const iterate = async () => {
      for await (const t of gen) {
        seen.push(t);
        if (seen.length === 2) controller.abort();
      }
    };
    await assert.rejects(iterate(), (e: Error) => e.name === "AbortError");
    assert.equal(gen.result, undefined);
    assert.ok(seen.length >= 2 && seen.length < 200);
    const history = (await s.append([9])) - 1;
    assert.ok(history < 2 + 200, `aborted late: history ${history}`);
    await s.close();
  });

  it("an aborted signal refuses unary calls and Generate before any work", async () => {
    const s = await client.createSession({ initialTokens: [3] });
    const reason = new Error("changed my mind");
    const signal = AbortSignal.abort(reason);
    await assert.rejects(s.append([4], { signal }), (e) => e === reason);
    await assert.rejects(s.generate({ maxTokens: 5, signal }).collect(), (e) => e === reason);
    await assert.rejects(s.export({ signal }), (e) => e === reason);
    const info = await s.info();
    assert.equal(info.historyLength, 1);
    assert.equal(info.generateCalls, 0);
    await s.close();
  });

  it("closing a Generation's iterator before its first token stops the server's work", async () => {
    const s = await client.createSession({ initialTokens: [5, 6] });
    const gen = s.generate({ maxTokens: 200, ignoreEos: true });
    const done = await gen[Symbol.asyncIterator]().return!();
    assert.equal(done.done, true);
    for (let i = 0; i < 100 && (await s.info()).generating; i++) await new Promise((r) => setTimeout(r, 20));
    const info = await s.info();
    assert.equal(info.generating, false);
    assert.ok(info.historyLength < 2 + 200, `not cancelled: history ${info.historyLength}`);
    await s.close();
  });

  it("a stop that is neither a string nor an iterable is InvalidArgument, not a TypeError", async () => {
    const s = await client.createSession({ initialTokens: [5] });
    assert.throws(() => s.generate({ maxTokens: 2, stop: 5 as unknown as string }), InvalidArgument);
    await s.close();
  });

  it("options of the wrong type or an unknown name are InvalidArgument, never coerced or ignored", async () => {
    const bad = [5, ["sink_window"], new Map([["name", "sink_window"]]), { policy: "sink_window" },
      { name: "sink_window", params: new Map([["window", 16]]) }, { name: "sink_window", params: [16] }];
    for (const policy of bad) {
      await assert.rejects(client.createSession({ initialTokens: [5], policy: policy as never }), InvalidArgument);
    }
    await assert.rejects(client.createSession({ initialTokens: [5], polcy: "full" } as never), InvalidArgument);
    const s = await client.createSession({ initialTokens: [5], policy: null as never }); // null: the default policy
    assert.equal(s.policy?.name, "full");
    for (const options of [{ ignoreEos: "false" }, { ignoreEos: 0 }, { maxtokens: 5 }, { seed: "abc" }, { seed: {} },
      { seed: 1.5 }, { topP: "0.9" }]) {
      assert.throws(() => s.generate(options as never), InvalidArgument, JSON.stringify(options));
    }
    const unset = { maxTokens: 2, seed: null, topP: null, ignoreEos: true, temperature: 0.5, speculation: null } as never;
    assert.equal((await s.generate(unset).collect()).length, 2); // null leaves seed, topP and speculation unset
    const plain = await client.createSession({ initialTokens: [5], speculation: null as never });
    assert.equal((await plain.info()).speculation, null);
    await plain.close();
    for (const speculation of [5, ["history"], true]) {
      assert.throws(() => s.generate({ maxTokens: 1, speculation } as never), InvalidArgument, String(speculation));
      await assert.rejects(client.createSession({ initialTokens: [5], speculation } as never), InvalidArgument);
    }
    await assert.rejects(s.info({ includeHistory: "false" as never }), InvalidArgument);
    await assert.rejects(s.export({ includeKv: "0" as never }), InvalidArgument);
    assert.throws(() => client.session(123 as never), InvalidArgument);
    assert.throws(() => new Client(server.address, { timeoutMs: Number.NaN }), InvalidArgument);
    assert.throws(() => new Client(server.address, { timeoutMs: "1000" as never }), InvalidArgument);
    assert.throws(() => new Client(server.address, { apikey: KEY } as never), InvalidArgument);
    const tok = await client.tokenizer();
    assert.throws(() => tok.decode([-1]), InvalidArgument);
    assert.throws(() => tok.decode([1.5]), InvalidArgument);
    assert.throws(() => tok.encode(5 as never), InvalidArgument);
    await s.close();
  });

  it("cancel() ends the iteration quietly; committed tokens stay in the history", async () => {
    const s = await client.createSession({ initialTokens: [40, 41] });
    await s.generate({ maxTokens: 1, ignoreEos: true }).collect();
    assert.notEqual(s.lastResult, undefined);
    const gen = s.generate({ maxTokens: 200, ignoreEos: true });
    const got: number[] = [];
    for await (const t of gen) {
      got.push(t);
      if (got.length === 3) gen.cancel();
    }
    assert.equal(gen.result, undefined);
    assert.equal(s.lastResult, undefined); // not the turn before: a cancelled Generate has no result
    assert.ok(got.length >= 3 && got.length < 200);
    await s.append([1]);
    const info = await s.info({ includeHistory: true });
    assert.deepEqual(info.historyTokenIds!.slice(3, 3 + got.length), got);
    await s.close();
  });

  it("cancel() in the tick generate() started stops the server (grpc-js sent the call anyway)", async () => {
    const s = await client.createSession({ initialTokens: [50, 51] });
    const gen = s.generate({ maxTokens: 150, ignoreEos: true });
    gen.cancel();
    assert.deepEqual(await gen.collect(), []);
    await new Promise((resolve) => setTimeout(resolve, 300)); // 30 steps' time, were it generating
    const info = await s.info();
    assert.ok(info.historyLength <= 3 && !info.generating, `history ${info.historyLength}`);
    await s.close();
  });

  it("an aborted createSession leaves no session behind", async () => {
    // The server may have made the session when the abort comes; the call was cancelled and nobody learnt the id:
    // orphans held the key's quota (here 3 sessions) and evicted its real, idle session. Now each is closed.
    const small = await startTinyServer({ maxSessions: 3 });
    const c = new Client(small.address);
    try {
      const kept = await c.createSession({ initialTokens: [1, 2] });
      for (let i = 0; i < 6; i++) {
        const controller = new AbortController();
        const made = c.createSession({ initialTokens: [1, 2, 3], signal: controller.signal });
        controller.abort(new Error("changed my mind"));
        const error = await made.then(() => undefined, (e: unknown) => e);
        assert.ok(error instanceof Error && error.message === "changed my mind");
        await new Promise((resolve) => setTimeout(resolve, 150)); // its answer came, its session was closed
      }
      assert.equal((await kept.info()).historyLength, 2); // not evicted by orphans
      // closed right after the abort: the channel stays until the create answered and its session was closed (it
      // threw "Channel has been shut down" from the call's callback, crashing the process)
      const other = new Client(small.address);
      const controller = new AbortController();
      const made = other.createSession({ initialTokens: [1, 2, 3], signal: controller.signal });
      controller.abort(new Error("nah"));
      await made.then(() => undefined, () => undefined);
      other.close();
      await new Promise((resolve) => setTimeout(resolve, 300));
      const more = [await c.createSession(), await c.createSession()]; // the quota's other two: no orphan in the way
      assert.equal((await kept.info()).historyLength, 2);
      for (const s of more) await s.close();
    } finally {
      c.close();
      await small.stop();
    }
  });

  it("closing the client stops its open streams, which reject Cancelled", async () => {
    const c = new Client(server.address, { apiKey: KEY });
    const s = await c.createSession({ initialTokens: [60, 61] });
    const reader = client.session(s.id);
    const gen = s.generate({ maxTokens: 300, ignoreEos: true });
    const got: number[] = [];
    const failure = (async () => {
      for await (const t of gen) {
        got.push(t);
        if (got.length === 2) c.close();
      }
    })().then(() => undefined, (e: unknown) => e);
    const error = await failure;
    assert.ok(error instanceof KakeyaError && error.constructor.name === "Cancelled", String(error));
    // cancelled by its caller first, then the client closed: it ends quietly, as a cancel does
    const c2 = new Client(server.address, { apiKey: KEY });
    const s2 = await c2.createSession({ initialTokens: [62, 63] });
    const gen2 = s2.generate({ maxTokens: 300, ignoreEos: true });
    for await (const _ of gen2) {
      gen2.cancel();
      c2.close();
    }
    await new Promise((resolve) => setTimeout(resolve, 300));
    const info = await reader.info();
    assert.ok(info.historyLength < 2 + 300 && !info.generating, `history ${info.historyLength}`);
    await reader.close();
  });
});

describe("API keys", () => {
  it("another key's session id is NOT_FOUND, exactly like an unknown one", async () => {
    const mine = await client.createSession({ initialTokens: [1, 2, 3] });
    const bob = new Client(server.address, { apiKey: OTHER_KEY });
    try {
      const foreign = bob.session(mine.id);
      for (const call of [
        () => foreign.append([4]),
        () => foreign.info(),
        () => foreign.generate({ maxTokens: 1 }).collect(),
        () => foreign.close(),
      ]) {
        const e = await call().then(() => undefined, (err: unknown) => err);
        assert.ok(e instanceof SessionNotFound, `expected SessionNotFound, got ${String(e)}`);
        assert.equal(e.code, status.NOT_FOUND);
      }
      assert.equal((await mine.info()).historyLength, 3); // untouched
    } finally {
      bob.close();
    }
    await mine.close();
  });

  it("export and import move a session, its KV snapshot verified; a damaged archive is refused", async () => {
    const s = await client.createSession({ initialTokens: [10, 11, 12, 13] });
    const first = await s.generate({ maxTokens: 5, ignoreEos: true }).collect();
    const archive = await s.export({ includeKv: true });
    const moved = await client.importSession(archive);
    assert.notEqual(moved.id, s.id);
    assert.ok(moved.kvLoaded);
    const info = await moved.info({ includeHistory: true });
    assert.deepEqual(info.historyTokenIds, [10, 11, 12, 13, ...first]);
    assert.equal(info.cachedLength, 8); // the snapshot holds all but the last sampled token
    const next = await moved.generate({ maxTokens: 4, ignoreEos: true }).collect();
    assert.deepEqual(await s.generate({ maxTokens: 4, ignoreEos: true }).collect(), next);
    const light = await client.importSession(await s.export());
    assert.equal(light.kvLoaded, false);
    const untrusted = await client.importSession(archive, { loadKv: false }); // its KV left out: recomputed
    assert.equal(untrusted.kvLoaded, false);
    assert.equal((await untrusted.info()).cachedLength, 0);
    await assert.rejects(client.importSession(archive, { loadKv: "no" as unknown as boolean }), InvalidArgument);
    const e = await client.importSession(archive.subarray(0, archive.length - 7)).then(() => undefined, (err: unknown) => err);
    assert.ok(e instanceof InvalidArgument);
    const foreign = new Client(server.address, { apiKey: OTHER_KEY });
    try {
      const gone = await foreign.session(s.id).export().then(() => undefined, (err: unknown) => err);
      assert.ok(gone instanceof SessionNotFound);
    } finally {
      foreign.close();
    }
    for (const x of [s, moved, light]) await x.close();
  });

  it("a missing or wrong key is UNAUTHENTICATED", async () => {
    for (const apiKey of [undefined, "not-a-valid-key-0000"]) {
      const c = new Client(server.address, { apiKey });
      try {
        const e = await c.modelInfo().then(() => undefined, (err: unknown) => err);
        assert.ok(e instanceof Unauthenticated);
        assert.equal(e.code, status.UNAUTHENTICATED);
      } finally {
        c.close();
      }
    }
  });

  it("a key no header can carry is refused at construction; a closed client's calls reject typed", async () => {
    for (const apiKey of ["ключ-ключ-1", "key-with\nnewline", " spaced-key"]) {
      assert.throws(() => new Client(server.address, { apiKey }), InvalidArgument);
    }
    const c = new Client(server.address, { apiKey: KEY });
    const s = await c.createSession({ initialTokens: [1, 2] });
    c.close();
    const calls: (() => Promise<unknown>)[] = [
      () => c.modelInfo(), () => c.createSession({ initialTokens: [1] }), () => s.info(), () => s.append([3]),
      async () => collect(s.generate({ maxTokens: 1 })), () => s.export(), // generate throws as it starts () => c.importSession(Buffer.from("x")),
    ];
    for (const call of calls) await assert.rejects(call(), FailedPrecondition);
    await client.session(s.id).close(); // the same key's other client frees it
  });
});
