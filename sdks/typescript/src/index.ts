/**
 * TypeScript client for the Kakeya runtime (gRPC kakeya.v1), generated from the same .proto as the Python SDK.
 *
 *     import { Client } from "@kakeya/client";
 *     const client = new Client("127.0.0.1:50051");
 *     const session = await client.createSession({ initialTokens: ids });
 *     for await (const tokenId of session.generate({ maxTokens: 128 })) { ... }
 *     await session.close();
 */

export { Client, Generation, Session } from "./client.js";
export type { CallSignal, ClientOptions, GenerateOptions } from "./client.js";
export {
  Aborted, Cancelled, DeadlineExceeded, FailedPrecondition, fromServiceError, InternalError, InvalidArgument,
  KakeyaError, PermissionDenied, ResourceExhausted, SessionNotFound, Unauthenticated, Unavailable,
} from "./errors.js";
export {
  ChatTemplateError, ChatTemplateMismatch, chatMessagesFromOpenAI, fromOpenAIMessages, StreamDecoder, Tokenizer,
  tokensForChat,
} from "./tokenization.js";
export type {
  ChatMessage, ChatOptions, ChatTemplateTokenizer, OpenAIMessage, StreamDecoderOptions, ToolCall,
} from "./tokenization.js";
export { textBeforeStop } from "./types.js";
export type {
  FinishReason, GenerateResult, GenerateStats, KvPolicy, ModelInfo, SessionInfo, SparseCounters, SparseStats,
  Speculation,
} from "./types.js";
