import { Client } from "@kakeya/client";

const client = new Client(process.env.KAKEYA_ADDR ?? "127.0.0.1:50051");
const tok = await client.tokenizer(); // the model's tokenizer and chat template, from the server
const messages = [{ role: "user", content: "Name the capital city of France." }];
const session = await client.createSession({ initialTokens: tok.tokensForChat(messages) });
for await (const text of tok.decodeStream(session.generate({ maxTokens: 48 }))) process.stdout.write(text);
messages.push({ role: "assistant", content: tok.decode(session.lastResult.tokenIds) }, { role: "user", content: "And of Italy?" });
await session.append(tok.chatDelta((await session.info({ includeHistory: true })).historyTokenIds, messages));
for await (const text of tok.decodeStream(session.generate({ maxTokens: 48 }))) process.stdout.write(text);
await session.close(); client.close();
