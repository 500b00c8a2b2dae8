/** TLS: a server started with a certificate serves only TLS; the client connects trusting that certificate. */

import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";

import { Client, Unauthenticated, Unavailable } from "../src/index.js";
import { startTinyServer, type RunningServer } from "./server.js";

const KEY = "test-key-tls-000001";
let dir: string;
let server: RunningServer;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "kakeya-tls-"));
  server = await startTinyServer({ apiKeys: [KEY], tlsDir: dir });
});

after(async () => {
  await server?.stop();
  rmSync(dir, { recursive: true, force: true });
});

describe("TLS", () => {
  it("connects with the server's certificate, as a path or as PEM contents (bytes or text)", async () => {
    const certPath = join(dir, "server.crt");
    for (const rootCertificates of [certPath, readFileSync(certPath), readFileSync(certPath, "utf8")]) {
      const client = new Client(server.address, { apiKey: KEY, rootCertificates, timeoutMs: 10_000 });
      try {
        assert.equal((await client.modelInfo()).modelName, "tiny-llama");
        const session = await client.createSession({ initialTokens: [10, 11] });
        assert.equal((await session.generate({ maxTokens: 3, ignoreEos: true }).collect()).length, 3);
        await session.close();
      } finally {
        client.close();
      }
    }
    const wrongKey = new Client(server.address, { apiKey: "wrong-key-000000000", rootCertificates: certPath });
    await assert.rejects(wrongKey.modelInfo(), Unauthenticated);
    wrongKey.close();
  });

  it("refuses plaintext clients and clients that do not trust the certificate", async () => {
    for (const tls of [false, true]) { // plaintext; TLS trusting only the system's roots (self-signed: untrusted)
      const client = new Client(server.address, { apiKey: KEY, tls, timeoutMs: 5000 });
      try {
        await assert.rejects(client.modelInfo(), Unavailable);
      } finally {
        client.close();
      }
    }
  });
});
