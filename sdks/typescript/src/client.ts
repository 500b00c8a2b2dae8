/** `Client` -> `Session` -> `Generation` (iterate with `for await` for token ids as they commit). */

import {
  credentials, Metadata, status,
  type CallOptions, type ChannelCredentials, type ChannelOptions, type ClientReadableStream, type ClientUnaryCall, type ServiceError,
} from "@grpc/grpc-js";

import { readFileSync } from "node:fs";

import * as cv from "./convert.js";
import { Cancelled, FailedPrecondition, fromServiceError, InvalidArgument, SessionNotFound } from "./errors.js";
import * as pb from "./rpc.js";
import { Tokenizer } from "./tokenization.js";
import type {
  FinishReason, GenerateResult, GenerateStats, KvPolicy, ModelInfo, SessionInfo, Speculation,
} from "./types.js";

export type { GenerateOptions } from "./convert.js";

// ImportSession's chunks stay under any server's receive limit (5 bytes per context token + 1 MiB).
const ARCHIVE_CHUNK_BYTES = 512 * 1024;

// Gemma 3's tokenizer.json is ~33 MB: the default 4 MB receive limit would refuse GetModelInfo.
const CHANNEL_OPTIONS: ChannelOptions = {
  "grpc.max_receive_message_length": 256 * 1024 * 1024,
  "grpc.max_send_message_length": 256 * 1024 * 1024,
};

export interface ClientOptions {
  /** Sent as `authorization: Bearer <key>`; each key sees only the sessions it created. */
  apiKey?: string;
  /** TLS trusting the system's root certificates (a server started with --tls-cert). */
  tls?: boolean;
  /** TLS trusting this CA (or self-signed certificate) instead: PEM contents, or the path of a PEM file. */
  rootCertificates?: Uint8Array | string;
  /** Deadline of each unary call in milliseconds; Generate streams are not time-limited. */
  timeoutMs?: number;
  /** Extra grpc-js channel options. */
  channelOptions?: ChannelOptions;
}

/** Every call takes an optional AbortSignal: aborting cancels the RPC and rejects with `signal.reason`. */
export interface CallSignal {
  signal?: AbortSignal;
}

type Callback<Res> = (error: ServiceError | null, response?: Res) => void;
type StartUnary<Res> = (metadata: Metadata, options: CallOptions, callback: Callback<Res>) => ClientUnaryCall;

function isServiceError(e: unknown): e is ServiceError {
  return e instanceof Error && typeof (e as ServiceError).code === "number";
}

/** Plaintext (fine on loopback; elsewhere the key would cross the network in clear) unless TLS is asked for. */
function channelCredentials(options: ClientOptions): ChannelCredentials {
  const roots = options.rootCertificates;
  if (roots === undefined) return options.tls ? credentials.createSsl() : credentials.createInsecure();
  if (typeof roots !== "string") return credentials.createSsl(Buffer.from(roots));
  // PEM contents start with a "-----BEGIN" line; anything else is a file's path
  return credentials.createSsl(roots.includes("-----BEGIN") ? Buffer.from(roots) : readFileSync(roots));
}

const CLIENT_OPTIONS = ["apiKey", "tls", "rootCertificates", "timeoutMs", "channelOptions"] as const;

/** A connection to one runtime. */
export class Client {
  readonly address: string;
  readonly timeoutMs: number | undefined;
  /** The generated grpc-js client, for anything this SDK does not wrap. */
  readonly stub: pb.RuntimeServiceClient;
  private readonly apiKey: string | undefined;
  private cachedModelInfo: ModelInfo | undefined;
  private isClosed = false;
  /** @internal Generations whose stream is open: close() stops them (grpc-js lets open calls run on). */
  readonly live = new Set<Generation>();
  /** Aborted calls that make a session, not answered yet: the channel stays open until their sessions are closed. */
  private abandoned = 0;
  private closeWhenAnswered = false;

  constructor(address = "127.0.0.1:50051", options: ClientOptions = {}) {
    cv.checkOptions(options, CLIENT_OPTIONS, "Client");
    if (typeof address !== "string") throw new InvalidArgument(`address must be a string, got ${cv.describe(address)}`);
    const timeout = options.timeoutMs;
    if (timeout != null && !(typeof timeout === "number" && Number.isFinite(timeout) && timeout > 0)) {
      throw new InvalidArgument(`timeoutMs must be a positive number of milliseconds, got ${cv.describe(timeout)}`);
    }
    this.address = address;
    this.timeoutMs = timeout ?? undefined;
    // Checked here: grpc-js would refuse such a header only at the first call, with an error of its own.
    if (options.apiKey && (!/^[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?$/.test(options.apiKey))) {
      throw new InvalidArgument("apiKey must be a string of printable ASCII characters without surrounding spaces");
    }
    this.apiKey = options.apiKey;
    const { RuntimeService } = pb.runtimeProto().kakeya.v1;
    this.stub = new RuntimeService(address, channelCredentials(options),
      { ...CHANNEL_OPTIONS, ...options.channelOptions });
  }

  /** @internal */
  metadata(): Metadata {
    if (this.isClosed) throw new FailedPrecondition("this client is closed");
    return this.keyMetadata();
  }

  private keyMetadata(): Metadata {
    const md = new Metadata();
    if (this.apiKey) md.set("authorization", `Bearer ${this.apiKey}`);
    return md;
  }

  /** @internal A call's options: the client-wide deadline, if any (every call but Generate's stream). */
  callOptions(): CallOptions {
    return this.timeoutMs === undefined ? {} : { deadline: Date.now() + this.timeoutMs };
  }

  /** @internal */
  /**
   * `madeSession`: the call makes a session (its id in the answer). Aborted, such a call is not cancelled: the
   * server may have made the session already, and nobody would learn its id. The promise rejects at once and the
   * session the call makes is closed when it answers.
   */
  unary<Res>(start: StartUnary<Res>, signal?: AbortSignal, madeSession?: (response: Res) => string): Promise<Res> {
    return new Promise<Res>((resolve, reject) => {
      if (signal?.aborted) {
        reject(signal.reason);
        return;
      }
      const options = this.callOptions();
      let call: ClientUnaryCall | undefined;
      let abandoned = false;
      const onAbort = () => {
        if (madeSession === undefined) {
          call?.cancel();
          setImmediate(() => call?.cancel()); // grpc-js 1.14 still sends a call cancelled in the tick it started
        } else {
          abandoned = true;
          this.abandoned += 1;
          reject(signal?.reason);
        }
      };
      call = start(this.metadata(), options, (error, response) => {
        signal?.removeEventListener("abort", onAbort);
        if (abandoned) {
          if (!error && response !== undefined) this.closeQuietly(madeSession!(response as Res), () => this.answered());
          else this.answered();
        } else if (error) {
          reject(signal?.aborted && error.code === status.CANCELLED ? signal.reason : fromServiceError(error));
        } else {
          resolve(response as Res);
        }
      });
      signal?.addEventListener("abort", onAbort, { once: true }); // (after start: a closed client's throw leaves none)
    });
  }

  private closeQuietly(sessionId: string, then: () => void): void {
    try { // (also after close(): the channel stays open for it)
      this.stub.closeSession({ sessionId }, this.keyMetadata(), {}, () => then());
    } catch {
      then(); // the channel is gone: nothing more to do
    }
  }

  private answered(): void {
    this.abandoned -= 1;
    if (this.abandoned === 0 && this.closeWhenAnswered) this.stub.close();
  }

  /** Vocab, EOS/BOS, context length, tokenizer.json and chat template (cached after the first call). */
  async modelInfo(options: { refresh?: boolean } & CallSignal = {}): Promise<ModelInfo> {
    if (this.cachedModelInfo === undefined || options.refresh) {
      const r = await this.unary<pb.GetModelInfoResponse>((md, o, cb) => this.stub.getModelInfo({}, md, o, cb),
        options.signal);
      this.cachedModelInfo = cv.modelInfoFromPb(r);
    }
    return this.cachedModelInfo;
  }

  /** A local tokenizer built from GetModelInfo's tokenizer.json and chat template. */
  async tokenizer(options: CallSignal = {}): Promise<Tokenizer> {
    return Tokenizer.fromModelInfo(await this.modelInfo(options));
  }

  async createSession(
    options: {
      initialTokens?: Iterable<number>;
      policy?: KvPolicy | string;
      /** The session's default speculation for Generates that set none (absent: off). */
      speculation?: Speculation | string;
    } & CallSignal = {},
  ): Promise<Session> {
    cv.checkOptions(options, ["initialTokens", "policy", "speculation", "signal"], "createSession");
    const request: pb.CreateSessionRequest = {
      initialTokenIds: cv.tokenList(options.initialTokens ?? [], "initialTokens"),
      policy: cv.policyToPb(options.policy),
      speculation: cv.speculationToPb(options.speculation),
    };
    const r = await this.unary<pb.CreateSessionResponse>((md, o, cb) => this.stub.createSession(request, md, o, cb),
      options.signal, (made) => made.sessionId);
    return new Session(this, r.sessionId, { historyLength: r.historyLength, policy: cv.policyFromPb(r.policy) });
  }

  /** A handle on an existing session id (no RPC; the first call tells whether it exists). */
  session(sessionId: string): Session {
    if (typeof sessionId !== "string") {
      throw new InvalidArgument(`a session id is a string, got ${cv.describe(sessionId)}`);
    }
    return new Session(this, sessionId);
  }

  /**
   * A new session (a new id, owned by this client's key) from an archive `Session.export` made, as bytes or a file
   * path, on this server or another serving the same model. A KV snapshot in the archive is checked against the
   * history it records and loaded (`session.kvLoaded`); a mismatching one rejects with InvalidArgument and creates
   * nothing. Its values are trusted: `{ loadKv: false }` for an archive from a source you do not trust (the server
   * recomputes the cache from the history).
   */
  async importSession(archive: Uint8Array | string, options: { loadKv?: boolean } & CallSignal = {}): Promise<Session> {
    cv.checkOptions(options, ["loadKv", "signal"], "importSession");
    const ignoreKv = !cv.flag(options.loadKv, "loadKv", true);
    const data = typeof archive === "string" ? readFileSync(archive) : Buffer.from(archive);
    const r = await this.unary<pb.ImportSessionResponse>((md, o, cb) => {
      const call = this.stub.importSession(md, o, cb);
      for (let at = 0; at < Math.max(data.length, 1); at += ARCHIVE_CHUNK_BYTES) {
        call.write({ data: data.subarray(at, at + ARCHIVE_CHUNK_BYTES), ignoreKv });
      }
      call.end();
      return call as unknown as ClientUnaryCall;
    }, options.signal, (made) => made.sessionId);
    const session = new Session(this, r.sessionId, { historyLength: r.historyLength, policy: cv.policyFromPb(r.policy) });
    session.kvLoaded = r.kvLoaded;
    return session;
  }

  /** Closes the connection; open Generate streams stop (the server's work too) and reject with Cancelled. */
  close(): void {
    this.isClosed = true;
    for (const generation of [...this.live]) generation.stopForClose();
    if (this.abandoned > 0) this.closeWhenAnswered = true; // the channel closes once their sessions are closed
    else this.stub.close();
  }
}

/** A server-owned session: append raw token ids, generate, inspect, close. */
export class Session {
  readonly client: Client;
  readonly id: string;
  /** As of the last call that reported it. */
  historyLength: number | undefined;
  policy: KvPolicy | undefined;
  /** The result of the last Generate that finished; undefined while one runs, and after one was cancelled or failed. */
  lastResult: GenerateResult | undefined;
  /** Imported with a KV snapshot that the server verified and loaded. */
  kvLoaded = false;
  private closed = false;

  constructor(client: Client, sessionId: string, init: { historyLength?: number; policy?: KvPolicy } = {}) {
    this.client = client;
    this.id = sessionId;
    this.historyLength = init.historyLength;
    this.policy = init.policy;
  }

  /** Append raw token ids; resolves to the new history length. */
  async append(tokenIds: Iterable<number>, options: CallSignal = {}): Promise<number> {
    const request: pb.AppendTokensRequest = { sessionId: this.id, tokenIds: cv.tokenList(tokenIds, "tokenIds") };
    const r = await this.client.unary<pb.AppendTokensResponse>(
      (md, o, cb) => this.client.stub.appendTokens(request, md, o, cb), options.signal);
    this.historyLength = r.historyLength;
    return r.historyLength;
  }

  /**
   * Start a Generate; iterate the result with `for await` for token ids. Leaving the loop early cancels it.
   *
   * `temperature` 0 (the default) is greedy; `topK` 0 keeps the whole vocabulary, `topP` is a nucleus mass in
   * (0, 1], and a `seed` makes sampling reproducible. `stopTokens` stop on top of the model's EOS ids (unless
   * `ignoreEos`); `stop` strings end it after the token that completes one (see GenerateOptions.stop). Bad values
   * reject with InvalidArgument and leave the session unchanged.
   */
  generate(options: cv.GenerateOptions = {}): Generation {
    const request = cv.generateRequest(this.id, options);
    this.lastResult = undefined;
    return new Generation(this, () => this.client.stub.generate(request, this.client.metadata()), options.signal);
  }

  async info(options: { includeHistory?: boolean } & CallSignal = {}): Promise<SessionInfo> {
    cv.checkOptions(options, ["includeHistory", "signal"], "info");
    const includeHistory = cv.flag(options.includeHistory, "includeHistory");
    const request: pb.GetSessionInfoRequest = { sessionId: this.id, includeHistory };
    const r = await this.client.unary<pb.GetSessionInfoResponse>(
      (md, o, cb) => this.client.stub.getSessionInfo(request, md, o, cb), options.signal);
    const info = cv.sessionInfoFromPb(r, includeHistory);
    this.historyLength = info.historyLength;
    return info;
  }

  /**
   * The session as an archive (policy, context, whole history; with `includeKv` a snapshot of its KV cache, so an
   * importer need not recompute it). `Client.importSession` takes it back on any server of the same model.
   */
  async export(options: { includeKv?: boolean } & CallSignal = {}): Promise<Buffer> {
    cv.checkOptions(options, ["includeKv", "signal"], "export");
    const includeKv = cv.flag(options.includeKv, "includeKv");
    if (options.signal?.aborted) throw options.signal.reason; // as every other call: nothing is sent
    const call = this.client.stub.exportSession({ sessionId: this.id, includeKv }, this.client.metadata(),
      this.client.callOptions());
    const onAbort = () => {
      call.cancel();
      setImmediate(() => call.cancel()); // (grpc-js 1.14: see Generation.cancel)
    };
    options.signal?.addEventListener("abort", onAbort, { once: true });
    const parts: Buffer[] = [];
    try {
      for await (const chunk of call as AsyncIterable<pb.ExportSessionResponse>) parts.push(chunk.data);
    } catch (e) {
      if (options.signal?.aborted) throw options.signal.reason;
      throw isServiceError(e) ? fromServiceError(e) : e;
    } finally {
      options.signal?.removeEventListener("abort", onAbort);
    }
    return Buffer.concat(parts);
  }

  /** Free the session (idempotent on this handle). */
  async close(options: CallSignal = {}): Promise<void> {
    if (this.closed) return;
    await this.client.unary<pb.CloseSessionResponse>(
      (md, o, cb) => this.client.stub.closeSession({ sessionId: this.id }, md, o, cb), options.signal);
    this.closed = true;
  }

  /** Close, ignoring a session that is already gone (evicted or failed): nothing left to free. */
  async dispose(): Promise<void> {
    try {
      await this.close();
    } catch (e) {
      if (!(e instanceof SessionNotFound)) throw e;
    }
  }

  /** `await using session = await client.createSession()` closes it at the end of the block. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.dispose();
  }
}

type StreamEvent =
  | { kind: "message"; message: pb.GenerateResponse }
  | { kind: "error"; error: unknown }
  | { kind: "end" };

/** A running Generate. Iterate once for token ids; then `result` / `stats` / `finishReason`. */
export class Generation implements AsyncIterable<number> {
  readonly session: Session;
  readonly tokenIds: number[] = [];
  result: GenerateResult | undefined;
  private readonly call: ClientReadableStream<pb.GenerateResponse> | undefined;
  private readonly signal: AbortSignal | undefined;
  private readonly events: StreamEvent[] = [];
  private wake: (() => void) | undefined;
  private iterated = false;
  private cancelled = false;
  private closedClient = false;
  private readonly onAbort = () => this.cancel();

  /** @internal `start` opens the RPC (not at all when `signal` is already aborted). */
  constructor(session: Session, start: () => ClientReadableStream<pb.GenerateResponse>, signal?: AbortSignal) {
    this.session = session;
    this.signal = signal;
    const push = (event: StreamEvent) => {
      this.events.push(event);
      this.wake?.();
    };
    if (signal?.aborted) {
      this.call = undefined;
      push({ kind: "error", error: signal.reason });
      return;
    }
    const call = start();
    this.call = call;
    const client = session.client;
    const ended = () => {  // the stream is over: nothing left to stop (a never-iterated one leaves no listener)
      client.live.delete(this);
      signal?.removeEventListener("abort", this.onAbort);
    };
    // Listen from the start: grpc-js emits 'error' whether or not anyone listens (an unheard one would crash the
    // process), and a failure before iteration must still reach the caller.
    call.on("data", (message: pb.GenerateResponse) => push({ kind: "message", message }));
    call.on("error", (error: unknown) => { ended(); push({ kind: "error", error }); });
    call.on("end", () => { ended(); push({ kind: "end" }); });
    client.live.add(this);
    signal?.addEventListener("abort", this.onAbort, { once: true });
  }

  get stats(): GenerateStats | undefined {
    return this.result?.stats;
  }

  get finishReason(): FinishReason | undefined {
    return this.result?.finishReason;
  }

  [Symbol.asyncIterator](): AsyncIterator<number> {
    if (this.iterated) throw new Error("a Generation can be iterated only once (see .tokenIds)");
    this.iterated = true;
    const run = this.run();
    // A generator closed before its first next() never enters run()'s try, so its finally (which stops the
    // server's work) never runs: return() stops it here too. cancel() does nothing once the result is in.
    return {
      next: () => run.next(),
      return: async (value?: unknown) => {
        const out = await run.return(value as undefined);
        this.signal?.removeEventListener("abort", this.onAbort);
        this.cancel();
        return out;
      },
      throw: (error?: unknown) => run.throw(error),
    };
  }

  private async next(): Promise<StreamEvent> {
    while (this.events.length === 0) await new Promise<void>((resolve) => (this.wake = resolve));
    this.wake = undefined;
    return this.events.shift() as StreamEvent;
  }

  private async *run(): AsyncGenerator<number, void, undefined> {
    try {
      for (;;) {
        const event = await this.next();
        if (event.kind === "end") return;
        if (event.kind === "error") {
          if (this.signal?.aborted) throw this.signal.reason;
          if (this.closedClient) throw new Cancelled("the client was closed during the generation");
          if (this.cancelled && isServiceError(event.error) && event.error.code === status.CANCELLED) return;
          throw isServiceError(event.error) ? fromServiceError(event.error) : event.error;
        }
        const { tokens, done } = event.message;
        if (event.message.event === "tokens" && tokens) {
          for (const t of tokens.tokenIds) {
            this.tokenIds.push(t);
            yield t;
          }
        } else if (event.message.event === "done" && done) {
          this.result = cv.resultFromPb(done, this.tokenIds);
          this.session.lastResult = this.result;
          this.session.historyLength = this.result.historyLength;
        }
      }
    } finally {
      this.signal?.removeEventListener("abort", this.onAbort);
      if (this.result === undefined) this.cancel(); // the caller left early (break, throw): stop the server's work
    }
  }

  /** Run to the end; resolves to every generated token id. */
  async collect(): Promise<number[]> {
    for await (const _ of this) {
      // tokens accumulate in this.tokenIds
    }
    return this.tokenIds;
  }

  /** Stop generating. Tokens already committed stay in the session history (see Session.info). */
  cancel(): void {
    if (this.result === undefined && !this.cancelled) {
      this.cancelled = true;
      this.call?.cancel();
      // grpc-js 1.14 still sends a call cancelled in the tick it started (its metadata callback does not check that
      // the call ended): the server then generated every token. Cancelled again once that tick is over, it stops.
      setImmediate(() => this.call?.cancel());
    }
  }

  /** @internal The client closed: stop, and fail the stream with Cancelled (as the Python SDK does). */
  stopForClose(): void {
    if (this.result === undefined && !this.cancelled) { // (cancelled by its caller first: it ends quietly)
      this.closedClient = true;
      this.cancel();
    }
  }
}
