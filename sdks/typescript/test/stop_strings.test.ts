/** Stop strings in Generate against a real runtime (the tiny random llama): the same scenarios as the Python SDK's. */

import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { Client, InvalidArgument, textBeforeStop, type Tokenizer } from "../src/index.js";
import { startTinyServer, type RunningServer } from "./server.js";

const N = 60;
let server: RunningServer;
let client: Client;
let tok: Tokenizer;
let prompt: number[];
let refIds: number[];
let refText: string;

before(async () => {
  server = await startTinyServer();
  client = new Client(server.address);
  tok = await client.tokenizer();
  prompt = tok.encode("Once upon a time");
  const s = await client.createSession({ initialTokens: prompt });
  refIds = await s.generate({ maxTokens: N, ignoreEos: true }).collect(); // greedy, no stop strings
  refText = tok.decode(refIds);
  await s.close();
});

after(async () => {
  client?.close();
  await server?.stop();
});

/** A printable ASCII stop string of `width` characters first occurring at index >= 2 of `text`. */
function asciiStop(text: string, width: number): [string, number] {
  for (let i = 2; i + width <= text.length; i++) {
    const s = text.slice(i, i + width);
    if (/^[\x20-\x7e]+$/.test(s) && text.indexOf(s) === i) return [s, i];
  }
  throw new Error(`no ASCII run of ${width} in ${JSON.stringify(text)}`);
}

/** The number of tokens after which `stop` first appears in their text. */
function completingPrefix(ids: number[], stop: string): number {
  for (let k = 1; k <= ids.length; k++) if (tok.decode(ids.slice(0, k)).includes(stop)) return k;
  throw new Error(`${stop} never appears`);
}

describe("stop strings", () => {
  it("end the generation on the token completing one; the history keeps every token", async () => {
    const [stop, at] = asciiStop(refText, 2); // two single-byte tokens: the match spans a token boundary
    const k = completingPrefix(refIds, stop);
    assert.ok(k < N);
    const s = await client.createSession({ initialTokens: prompt });
    const gen = s.generate({ maxTokens: N, ignoreEos: true, stop: ["never appears \u2603", stop] });
    const ids = await gen.collect();
    assert.deepEqual(ids, refIds.slice(0, k));
    assert.equal(gen.finishReason, "stop");
    assert.equal(gen.result?.stopString, stop);
    assert.equal(textBeforeStop(tok.decode(ids), gen.result), refText.slice(0, at));
    const info = await s.info({ includeHistory: true });
    assert.deepEqual(info.historyTokenIds, [...prompt, ...ids]);
    assert.equal(gen.result?.historyLength, prompt.length + k);
    // A later Generate continues from exactly that history: greedy, it says what the unstopped run said next.
    const more = s.generate({ maxTokens: N - k, ignoreEos: true });
    assert.deepEqual(await more.collect(), refIds.slice(k));
    assert.equal(more.result?.stopString, null);
    assert.equal(more.finishReason, "length");
    await s.close();
  });

  it("streamed text stops where the result says", async () => {
    const [stop, at] = asciiStop(refText, 2);
    const s = await client.createSession({ initialTokens: prompt });
    const gen = s.generate({ maxTokens: N, ignoreEos: true, stop });
    const pieces: string[] = [];
    for await (const piece of tok.decodeStream(gen, { stop })) pieces.push(piece);
    assert.equal(pieces.join(""), refText.slice(0, at));
    assert.equal(pieces.join(""), textBeforeStop(tok.decode(gen.tokenIds), gen.result));
    await s.close();
  });

  it("a single string is one stop string; an unmatched one changes nothing", async () => {
    const [stop] = asciiStop(refText, 1);
    const s = await client.createSession({ initialTokens: prompt });
    const gen = s.generate({ maxTokens: N, ignoreEos: true, stop });
    assert.deepEqual(await gen.collect(), refIds.slice(0, completingPrefix(refIds, stop)));
    assert.equal(gen.result?.stopString, stop);
    await s.close();
    const t = await client.createSession({ initialTokens: prompt });
    const all = t.generate({ maxTokens: N, ignoreEos: true, stop: ["\u2603 not generated"] });
    assert.deepEqual(await all.collect(), refIds);
    assert.equal(all.finishReason, "length");
    assert.equal(textBeforeStop("abc", all.result), "abc");
    await t.close();
  });

  it("bad stop strings reject with InvalidArgument and change nothing", async () => {
    const s = await client.createSession({ initialTokens: [10, 11, 12] });
    const tooMany = Array.from({ length: 17 }, (_, i) => `s${i}`);
    for (const stop of [[""], ["x".repeat(257)], tooMany, [42 as unknown as string]]) {
      await assert.rejects(async () => s.generate({ maxTokens: 4, stop }).collect(), InvalidArgument);
    }
    const info = await s.info({ includeHistory: true });
    assert.deepEqual(info.historyTokenIds, [10, 11, 12]);
    assert.equal(info.generateCalls, 0);
    await s.close();
  });
});
