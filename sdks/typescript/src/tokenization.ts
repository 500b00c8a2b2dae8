/**
 * Client-side tokenization: the runtime never renders chat templates.
 *
 * GetModelInfo hands out the model's tokenizer.json and chat template as data. This module builds a tokenizer
 * from them (Hugging Face's tokenizers.js), renders the template the way Hugging Face does (@huggingface/jinja:
 * trim_blocks, lstrip_blocks, tojson), and computes the token *delta* a new chat turn adds to a session, so a
 * session's history stays the exact raw tokens it already holds (generated tokens included).
 */

import { Template } from "@huggingface/jinja";
import { Tokenizer as HFTokenizer } from "@huggingface/tokenizers";

import { describe, flag, tokenList } from "./convert.js";
import { InvalidArgument } from "./errors.js";
import type { ModelInfo } from "./types.js";

/** A chat message as templates take it (snake_case keys, as in Hugging Face templates and the OpenAI API). */
export interface ChatMessage {
  role: string;
  content: string;
  name?: string;
  tool_call_id?: string;
  tool_calls?: ToolCall[];
  [key: string]: unknown;
}

export interface ToolCall {
  type: string;
  id: string | null;
  function: { name?: string; arguments?: unknown; [key: string]: unknown };
}

export interface ChatOptions {
  /** End with the assistant's turn opener (default true). */
  addGenerationPrompt?: boolean;
  /** Extra template variables (e.g. `enable_thinking`, `tools`). */
  templateKwargs?: Record<string, unknown>;
  /**
   * Tokenize special-token text inside a message's content ("<|im_end|>") as the plain text it is, as the OpenAI
   * API treats content (default false: as Hugging Face's apply_chat_template, it becomes that control token, so a
   * message can close its own turn and open another). Content without such text tokenizes the same either way.
   */
  literalContent?: boolean;
}

// Unicode whitespace as Rust's char::is_whitespace has it (JavaScript's \s also takes U+FEFF and not U+0085).
const WS = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000";
// The GPT-2 split that ByteLevel(use_regex) runs, with that whitespace spelled out.
const GPT2_SPLIT = `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^${WS}\\p{L}\\p{N}]+|[${WS}]+(?![^${WS}])|[${WS}]+`;

type Json = Record<string, unknown>;

/**
 * The tokenizer.json with the two pre-tokenizers whose JavaScript regexes differ from Rust's (the tokenizers
 * library the server, the Python SDK and llama.cpp use) rewritten as equal explicit splits: Digits matched only
 * ASCII digits (JavaScript's \d; Rust: every numeric character, so "٣٤٥" or "²" tokenized differently), and
 * ByteLevel's GPT-2 split took JavaScript's \s (rewritten where it adds no prefix space, as in both bundled
 * models' tokenizers). For those, the same ids as the Rust tokenizer whatever the text; other pre-tokenizers are as
 * tokenizers.js has them.
 */
function rustRegexes(json: Json): Json {
  const rewrite = (p: Json): Json[] => {
    if (p.type === "Digits" && p.individual_digits === true) {
      return [{ type: "Split", pattern: { Regex: "\\p{N}" }, behavior: "Isolated", invert: false }];
    }
    // (with add_prefix_space, ByteLevel prefixes the whole text once: split first, it would prefix every piece)
    if (p.type === "ByteLevel" && p.use_regex !== false && p.add_prefix_space !== true) {
      return [{ type: "Split", pattern: { Regex: GPT2_SPLIT }, behavior: "Isolated", invert: false },
        { ...p, use_regex: false }];
    }
    if (p.type === "Sequence" && Array.isArray(p.pretokenizers)) {
      return [{ ...p, pretokenizers: (p.pretokenizers as Json[]).flatMap(rewrite) }];
    }
    return [p];
  };
  const pre = json.pre_tokenizer as Json | null | undefined;
  if (!pre) return json;
  const out = rewrite(pre);
  return { ...json, pre_tokenizer: out.length === 1 ? out[0] : { type: "Sequence", pretokenizers: out } };
}

/** The model has no chat template, or the template refused the messages. */
export class ChatTemplateError extends Error {
  constructor(message: string) {
    super(message);
    this.name = new.target.name;
  }
}

/** The rendered conversation does not extend the session's history text (e.g. the template trims or rewrites
 * earlier turns). Start a new session from `tokensForChat(messages)` instead. */
export class ChatTemplateMismatch extends ChatTemplateError {}

/** A tokenizers.js tokenizer plus the model's chat template and special tokens. */
export class Tokenizer {
  readonly hf: HFTokenizer;
  /** The tokenizer.json text it was built from. */
  readonly tokenizerJson: string;
  readonly chatTemplate: string | null;
  readonly bosTokenId: number | null;
  readonly eosTokenIds: readonly number[];
  private template: Template | undefined;

  constructor(tokenizerJson: string, options: { chatTemplate?: string | null; bosTokenId?: number | null;
    eosTokenIds?: Iterable<number> } = {}) {
    if (!tokenizerJson) throw new Error("the server sent no tokenizer.json for this model");
    this.tokenizerJson = tokenizerJson;
    this.hf = new HFTokenizer(rustRegexes(JSON.parse(tokenizerJson)), { clean_up_tokenization_spaces: false });
    this.chatTemplate = options.chatTemplate ?? null;
    this.bosTokenId = options.bosTokenId ?? null;
    this.eosTokenIds = [...(options.eosTokenIds ?? [])];
  }

  static fromModelInfo(info: ModelInfo): Tokenizer {
    return new Tokenizer(info.tokenizerJson, { chatTemplate: info.chatTemplate, bosTokenId: info.bosTokenId,
      eosTokenIds: info.eosTokenIds });
  }

  // ---- plain text ----------------------------------------------------------------------------

  get vocabSize(): number {
    return this.hf.get_vocab(true).size;
  }

  /** Text -> ids. Special-token text such as "<|im_start|>" maps to its id either way. */
  encode(text: string, options: { addSpecialTokens?: boolean } = {}): number[] {
    if (typeof text !== "string") throw new InvalidArgument(`encode takes a string, got ${describe(text)}`);
    return this.hf.encode(text, { add_special_tokens: flag(options.addSpecialTokens, "addSpecialTokens") }).ids;
  }

  /** Ids -> text; an id that is not a non-negative integer is refused (InvalidArgument), as the server refuses it. */
  decode(ids: Iterable<number>, options: { skipSpecialTokens?: boolean } = {}): string {
    const list = tokenList(ids, "decode");
    if (list.some((t) => t < 0)) throw new InvalidArgument("decode: token ids are non-negative");
    if (list.length === 0) return ""; // tokenizers.js refuses an empty list
    return this.hf.decode(list, { skip_special_tokens: options.skipSpecialTokens ?? true,
      clean_up_tokenization_spaces: false });
  }

  tokenText(tokenId: number | null | undefined): string {
    return tokenId == null ? "" : (this.hf.id_to_token(tokenId) ?? "");
  }

  get bosToken(): string {
    return this.tokenText(this.bosTokenId);
  }

  get eosToken(): string {
    return this.eosTokenIds.length ? this.tokenText(this.eosTokenIds[0]) : "";
  }

  /** Streamed text for a Generate; pass its `stop` strings to hold them back (see StreamDecoder). */
  streamDecoder(options: StreamDecoderOptions = {}): StreamDecoder {
    return new StreamDecoder(this, options);
  }

  /**
   * Text pieces as token ids arrive, e.g. `for await (const text of tok.decodeStream(session.generate()))`.
   * With `stop`, no part of a stop string is yielded and the text ends before the first one to complete.
   */
  async *decodeStream(ids: AsyncIterable<number> | Iterable<number>,
    options: StreamDecoderOptions = {}): AsyncGenerator<string, void, undefined> {
    const decoder = this.streamDecoder(options);
    for await (const id of ids) {
      const text = decoder.push(id);
      if (text) yield text;
    }
    const rest = decoder.flush();
    if (rest) yield rest;
  }

  // ---- chat ----------------------------------------------------------------------------------

  get hasChatTemplate(): boolean {
    return Boolean(this.chatTemplate);
  }

  /** The chat template rendered to text (Hugging Face semantics: trim_blocks, lstrip_blocks, tojson). */
  renderChat(messages: readonly ChatMessage[], options: ChatOptions = {}): string {
    if (!this.chatTemplate) throw new ChatTemplateError("this model has no chat template; tokenize plain text with encode(text, { addSpecialTokens: true }), which starts it with the BOS token");
    const bad = messages.findIndex((m) => typeof (m as { content?: unknown })?.content !== "string");
    if (bad >= 0) { // the template would print an object or a number into the prompt as text
      throw new ChatTemplateError(`message ${bad} has no string content: each message needs a 'role' and a string `
        + "'content' (fromOpenAIMessages converts OpenAI-style content parts)");
    }
    if (this.template === undefined) {
      try {
        this.template = new Template(this.chatTemplate);
      } catch (e) {
        throw new ChatTemplateError(`chat template does not compile: ${(e as Error).message}`);
      }
    }
    const context = {
      bos_token: this.bosToken,
      eos_token: this.eosToken,
      ...options.templateKwargs,
      messages: messages.map((m) => structuredClone(m)),
      add_generation_prompt: options.addGenerationPrompt ?? true,
    };
    try {
      return this.template.render(context);
    } catch (e) {
      throw new ChatTemplateError((e as Error).message); // raise_exception('...') in the template included
    }
  }

  /** The whole conversation as raw token ids (for `createSession({ initialTokens })`). */
  tokensForChat(messages: readonly ChatMessage[], options: ChatOptions = {}): number[] {
    return this.encodePieces(this.renderedPieces(messages, options));
  }

  /**
   * The rendered conversation as [text, literal] pieces, in order: their texts joined are the render; a literal
   * piece is special-token text from a message's content, to tokenize as plain text.
   */
  private renderedPieces(messages: readonly ChatMessage[], options: ChatOptions): [string, boolean][] {
    const specials = flag(options.literalContent, "literalContent") ? this.specialTexts() : [];
    const holds = (m: ChatMessage) => typeof m.content === "string" && specials.some((x) => m.content.includes(x));
    if (specials.length === 0 || !messages.some(holds)) return [[this.renderChat(messages, options), false]];
    // Each occurrence of special-token text in a message's content is rendered as a marker the template passes
    // through as it passes the text around it (filters, trimming, tests on the content still apply), then tokenized
    // as that text where the marker lands. Markers are private-use characters with a random part, so no message can
    // hold one by chance.
    const nonce = String.fromCharCode(...Array.from(crypto.getRandomValues(new Uint8Array(8)), (b) => 0xe100 + b));
    const pattern = new RegExp(specials.map((x) => x.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")).join("|"), "g");
    const literal = new Map<string, string>();
    const marked = messages.map((m) => typeof m.content !== "string" ? m : {
      ...m,
      content: m.content.replace(pattern, (found) => {
        const marker = `\ue000${nonce}${String.fromCharCode(0xf000 + literal.size)}\ue001`;
        literal.set(marker, found);
        return marker;
      }),
    });
    const pieces = this.renderChat(marked, options).split(new RegExp(`(\ue000${nonce}.\ue001)`));
    const seen = pieces.filter((_, i) => i % 2 === 1).sort();
    if (seen.length !== literal.size || seen.some((x, i) => x !== [...literal.keys()].sort()[i])) {
      throw new ChatTemplateError("the chat template dropped or repeated part of a message's content, so its "
        + "special-token text cannot be kept literal");
    }
    return pieces.flatMap((piece, i): [string, boolean][] => i % 2 === 1 ? [[literal.get(piece) as string, true]]
      : piece ? [[piece, false]] : []);
  }

  private encodePieces(pieces: readonly [string, boolean][]): number[] {
    return pieces.flatMap(([text, literal]) => literal ? this.encodeLiteral(text) : this.encode(text));
  }

  private literal: HFTokenizer | undefined;

  /** The special tokens' texts, longest first (so one that contains another is matched whole). */
  private specialTexts(): string[] {
    const added = (JSON.parse(this.tokenizerJson).added_tokens ?? []) as { content?: string; special?: boolean }[];
    return [...new Set(added.filter((t) => t.special && t.content).map((t) => t.content as string))]
      .sort((a, b) => b.length - a.length);
  }

  /** Text with its special-token text tokenized as plain text (the Rust tokenizer's encode_special_tokens). */
  private encodeLiteral(text: string): number[] {
    if (this.literal === undefined) {
      const json = rustRegexes(JSON.parse(this.tokenizerJson));
      const added = (json.added_tokens ?? []) as { special?: boolean }[];
      this.literal = new HFTokenizer({ ...json, added_tokens: added.filter((t) => !t.special) },
        { clean_up_tokenization_spaces: false });
    }
    return this.literal.encode(text, { add_special_tokens: false }).ids;
  }

  /**
   * Tokens to append so a session holding `historyIds` continues as `messages`.
   *
   * The history is the truth: generated tokens stay exactly as sampled. The rendered conversation must extend
   * the history's text; only the new suffix is tokenized. Throws ChatTemplateMismatch when it does not (the
   * caller then starts a fresh session from tokensForChat). `literalContent` as tokensForChat's: pass the value the
   * session's earlier turns were tokenized with.
   */
  chatDelta(historyIds: readonly number[], messages: readonly ChatMessage[], options: ChatOptions = {}): number[] {
    const pieces = this.renderedPieces(messages, options);
    if (historyIds.length === 0) return this.encodePieces(pieces);
    const rendered = pieces.map(([text]) => text).join("");
    const prefix = this.historyText(historyIds, rendered);
    if (!rendered.startsWith(prefix)) {
      let at = 0;
      while (at < Math.min(prefix.length, rendered.length) && prefix[at] === rendered[at]) at++;
      throw new ChatTemplateMismatch(`rendered chat diverges from the session history at character ${at}: `
        + `history ${JSON.stringify(prefix.slice(at, at + 40))} vs rendered ${JSON.stringify(rendered.slice(at, at + 40))}`);
    }
    const suffix: [string, boolean][] = [];
    let skip = prefix.length; // characters of the render the history already holds
    for (const [text, literal] of pieces) {
      if (skip < text.length) suffix.push([text.slice(skip), literal]); // a literal's tail is plain text too
      skip = Math.max(0, skip - text.length);
    }
    return this.encodePieces(suffix);
  }

  /**
   * The history's text, each EOS token in it read as the EOS the render has there: a reply that ended on another of
   * the model's EOS tokens than the one the template closes a turn with (SmolLM2's <|endoftext|> where it writes
   * <|im_end|>) stands for the turn's end, in the last turn and in every earlier one.
   */
  private historyText(historyIds: readonly number[], rendered: string): string {
    const ids = [...historyIds];
    const text = this.decode(ids, { skipSpecialTokens: false });
    if (rendered.startsWith(text)) return text;
    for (let i = 0; i < ids.length; i++) {
      if (!this.eosTokenIds.includes(ids[i])) continue;
      const before = this.decode(ids.slice(0, i), { skipSpecialTokens: false });
      if (!rendered.startsWith(before)) break; // the history diverges before this token: nothing to read differently
      const close = this.eosTokenIds.find((e) => this.tokenText(e) && rendered.startsWith(before + this.tokenText(e)));
      if (close !== undefined) ids[i] = close;
    }
    return this.decode(ids, { skipSpecialTokens: false });
  }
}

/** Options of a StreamDecoder: `stop` takes the stop strings given to `generate`. */
export interface StreamDecoderOptions {
  skipSpecialTokens?: boolean;
  stop?: string | readonly string[];
}

/**
 * Incremental detokenization: push token ids, get text as soon as it is complete.
 *
 * Decodes a short window before the new tokens and emits only the difference, so multi-byte characters split
 * across tokens and leading-space rules of SentencePiece-style decoders come out right.
 *
 * With `stop`, text that may still become a stop string is held back, and the stream ends just before the
 * first stop string to complete (of two completing on the same character, the longer): the displayed text never
 * shows any part of it. `stopString` then says which one matched, as the server's result does.
 */
export class StreamDecoder {
  readonly tokenizer: Tokenizer;
  readonly skipSpecialTokens: boolean;
  readonly stops: readonly string[];
  readonly ids: number[] = [];
  /** The stop string the text reached, once it did. */
  stopString: string | null = null;
  private held = ""; // text that may still become a stop string
  private prefix = 0;
  private read = 0;
  private sent = 0; // UTF-16 units after the read offset already emitted (before an incomplete character)

  constructor(tokenizer: Tokenizer, options: StreamDecoderOptions = {}) {
    this.tokenizer = tokenizer;
    this.skipSpecialTokens = options.skipSpecialTokens ?? true;
    const stop = options.stop ?? [];
    this.stops = [...new Set(typeof stop === "string" ? [stop] : stop)];
    if (!this.stops.every((s) => typeof s === "string" && s.length > 0)) {
      throw new TypeError("stop strings must be non-empty strings");
    }
  }

  private decodeRange(ids: number[]): string {
    return this.tokenizer.decode(ids, { skipSpecialTokens: this.skipSpecialTokens });
  }

  push(tokenId: number): string {
    this.ids.push(tokenId);
    const before = this.decodeRange(this.ids.slice(this.prefix, this.read));
    const text = this.decodeRange(this.ids.slice(this.prefix));
    const start = before.length + this.sent;
    if (text.length > before.length && !text.endsWith("\ufffd")) {
      this.prefix = this.read;
      this.read = this.ids.length;
      this.sent = 0;
      return this.holdBack(text.slice(start));
    }
    // A token may end complete characters and begin an incomplete one (a space and an emoji's first bytes):
    // the complete ones go now (a stop string may end in them); only the incomplete tail waits.
    const complete = text.replace(/\ufffd+$/u, "").length;
    if (complete > start) {
      this.sent += complete - start;
      return this.holdBack(text.slice(start, complete));
    }
    return "";
  }

  /** Whatever is still held back (an incomplete character, or text that did not become a stop string). */
  flush(): string {
    const before = this.decodeRange(this.ids.slice(this.prefix, this.read));
    const text = this.decodeRange(this.ids.slice(this.prefix));
    const start = before.length + this.sent;
    this.prefix = this.read = this.ids.length;
    this.sent = 0;
    let out = this.holdBack(text.slice(start));
    if (this.stopString === null) {
      out += this.held;
      this.held = "";
    }
    return out;
  }

  private holdBack(piece: string): string {
    if (this.stops.length === 0) return piece;
    if (this.stopString !== null) return "";
    const text = this.held + piece;
    // Text already emitted was no stop string's prefix, so a match can only start inside `text`.
    let best: { end: number; start: number; stop: string } | null = null;
    for (const stop of this.stops) {
      const start = text.indexOf(stop);
      if (start < 0) continue;
      const end = start + stop.length;
      if (best === null || end < best.end || (end === best.end && stop.length > best.stop.length)) {
        best = { end, start, stop };
      }
    }
    if (best !== null) {
      this.stopString = best.stop;
      this.held = "";
      return text.slice(0, best.start);
    }
    let keep = 0;
    for (const stop of this.stops) {
      for (let k = Math.min(stop.length - 1, text.length); k > keep; k--) {
        if (text.endsWith(stop.slice(0, k))) {
          keep = k;
          break;
        }
      }
    }
    this.held = text.slice(text.length - keep);
    return text.slice(0, text.length - keep);
  }
}

/** Anything with transformers.js's `apply_chat_template` (a PreTrainedTokenizer) also renders chats. */
export interface ChatTemplateTokenizer {
  apply_chat_template(messages: ChatMessage[], options: Record<string, unknown>): unknown;
}

/**
 * Render `messages` with the model's chat template and tokenize, client-side.
 *
 * `tokenizer` is a kakeya Tokenizer (from GetModelInfo) or a transformers.js tokenizer.
 */
export function tokensForChat(messages: readonly ChatMessage[], tokenizer: Tokenizer | ChatTemplateTokenizer,
  options: ChatOptions = {}): number[] {
  if (tokenizer instanceof Tokenizer) return tokenizer.tokensForChat(messages, options);
  if (tokenizer && typeof (tokenizer as ChatTemplateTokenizer).apply_chat_template === "function") {
    let ids = tokenizer.apply_chat_template([...messages], {
      ...options.templateKwargs, tokenize: true, return_tensor: false,
      add_generation_prompt: options.addGenerationPrompt ?? true,
    }) as unknown;
    if (ids && typeof ids === "object" && "input_ids" in ids) ids = (ids as { input_ids: unknown }).input_ids;
    return Array.from(ids as Iterable<number | bigint>, Number);
  }
  throw new TypeError(`cannot render a chat template with ${String(tokenizer)}`);
}

/** An OpenAI chat-completions message (the request's `messages` items). */
export interface OpenAIMessage {
  role: string;
  content?: string | null | ReadonlyArray<{ type: string; text?: string; [key: string]: unknown }>;
  name?: string;
  tool_call_id?: string;
  tool_calls?: ReadonlyArray<{ id?: string; type?: string; function?: { name?: string; arguments?: unknown } }>;
  [key: string]: unknown;
}

/**
 * OpenAI chat-completions messages + the model's tokenizer -> the token ids a session takes.
 *
 * The one-helper migration from the HTTP endpoint to sessions: what `POST /v1/chat/completions` would have
 * prompted with becomes `client.createSession({ initialTokens: fromOpenAIMessages(messages, tok) })`. For later
 * turns of the same session append `tok.chatDelta(history, chatMessagesFromOpenAI(messages), { literalContent: true })`
 * instead.
 */
export function fromOpenAIMessages(messages: Iterable<OpenAIMessage>, tokenizer: Tokenizer | ChatTemplateTokenizer,
  options: ChatOptions = {}): number[] {
  const chat = chatMessagesFromOpenAI(messages);
  const literalContent = flag(options.literalContent, "literalContent", true);
  if (tokenizer instanceof Tokenizer) return tokenizer.tokensForChat(chat, { ...options, literalContent });
  const all = (tokenizer as { all_special_tokens?: unknown }).all_special_tokens;
  const specials = Array.isArray(all) ? all.filter((t): t is string => typeof t === "string" && t !== "") : [];
  const held = chat.flatMap((m) => specials.filter((t) => typeof m.content === "string" && m.content.includes(t)))[0];
  if (literalContent && held !== undefined) {
    throw new ChatTemplateError(`a message's content holds the special-token text ${JSON.stringify(held)}, which `
      + "this tokenizer would read as that control token: use a kakeya Tokenizer (Tokenizer.fromModelInfo), which "
      + "keeps it as text, or pass literalContent: false");
  }
  return tokensForChat(chat, tokenizer, options);
}

/**
 * OpenAI chat-completions messages -> the plain messages chat templates expect.
 *
 * Text content parts are joined; `developer` becomes `system` (templates rarely know it); tool calls keep their
 * structure with JSON `arguments` parsed, as Hugging Face templates expect. Non-text parts (images, audio) are
 * refused rather than silently dropped.
 */
export function chatMessagesFromOpenAI(messages: Iterable<OpenAIMessage>): ChatMessage[] {
  const out: ChatMessage[] = [];
  for (const m of messages) {
    if (!m || !m.role) throw new TypeError(`message without a role: ${JSON.stringify(m)}`);
    const msg: ChatMessage = { role: m.role === "developer" ? "system" : m.role, content: contentText(m.content) };
    if (m.name) msg.name = m.name;
    if (m.tool_call_id) msg.tool_call_id = m.tool_call_id;
    if (m.tool_calls?.length) msg.tool_calls = m.tool_calls.map(toolCall);
    out.push(msg);
  }
  return out;
}

function contentText(content: OpenAIMessage["content"]): string {
  if (content == null) return "";
  if (typeof content === "string") return content;
  return content.map((part) => {
    if (part?.type !== "text") {
      throw new TypeError(`unsupported content part ${JSON.stringify(part?.type)}: only text parts can be tokenized`);
    }
    return part.text ?? "";
  }).join("");
}

function toolCall(tc: NonNullable<OpenAIMessage["tool_calls"]>[number]): ToolCall {
  const fn: ToolCall["function"] = { ...tc.function };
  if (typeof fn.arguments === "string") {
    try {
      fn.arguments = fn.arguments ? JSON.parse(fn.arguments) : {};
    } catch {
      // not JSON: keep the raw string; templates may print it
    }
  }
  return { type: tc.type ?? "function", id: tc.id ?? null, function: fn };
}
