/** Real servers for the tests: the tiny random llama (fast) and `kakeya serve` on a bundled model. */

import { spawn } from "node:child_process";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

// dist/test/ -> sdks/typescript/ -> the repository root.
export const PACKAGE_ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
export const REPO_ROOT = resolve(PACKAGE_ROOT, "../..");
/** The runtime's Python (the repository's venv unless KAKEYA_PYTHON says otherwise). */
export const PYTHON = process.env.KAKEYA_PYTHON ?? join(REPO_ROOT, ".venv", "bin", "python");

export interface RunningServer {
  address: string;
  stop(): Promise<void>;
}

/** Spawn a server process and wait for its address (the first stdout line that looks like host:port). */
export async function startServer(args: string[], timeoutMs = 180_000): Promise<RunningServer> {
  const child = spawn(PYTHON, args, { cwd: REPO_ROOT, stdio: ["pipe", "pipe", "pipe"] });
  const killOnExit = () => child.kill("SIGKILL");
  process.on("exit", killOnExit);
  let stderr = "";
  child.stderr.on("data", (chunk: Buffer) => {
    stderr = (stderr + chunk.toString()).slice(-4000);
  });
  const exited = new Promise<number | null>((res) => child.once("exit", (code) => res(code)));
  const address = await new Promise<string>((res, rej) => {
    const timer = setTimeout(() => rej(new Error(`server did not start in ${timeoutMs} ms: ${stderr}`)), timeoutMs);
    const lines = createInterface({ input: child.stdout });
    lines.on("line", (line) => {
      if (/^\S+:\d+$/.test(line.trim())) {
        clearTimeout(timer);
        res(line.trim());
      }
    });
    void exited.then((code) => {
      clearTimeout(timer);
      rej(new Error(`server exited with ${code} before starting: ${stderr}`));
    });
  });
  return {
    address,
    async stop() {
      child.stdin.end(); // the tiny test server exits when stdin closes
      child.kill("SIGTERM"); // `kakeya serve` on SIGTERM
      const timer = setTimeout(() => child.kill("SIGKILL"), 15_000);
      await exited;
      clearTimeout(timer);
      process.off("exit", killOnExit);
    },
  };
}

/** The tiny random llama (vocab 259: ChatML specials + bytes, context 512, EOS 2). */
export function startTinyServer(
  options: { apiKeys?: string[]; stepDelayS?: number; tlsDir?: string; maxSessions?: number } = {},
): Promise<RunningServer> {
  const args = ["-m", "kakeya_runtime.server.testing_serve"];
  if (options.maxSessions) args.push("--max-sessions", String(options.maxSessions));
  for (const key of options.apiKeys ?? []) args.push("--api-key", key);
  if (options.stepDelayS) args.push("--step-delay", String(options.stepDelayS));
  if (options.tlsDir) args.push("--tls-dir", options.tlsDir); // a self-signed certificate in tlsDir/server.crt
  return startServer(args);
}

/** `kakeya serve` on a bundled model, any free port, no metrics endpoint. */
export function startModelServer(model = "smollm2"): Promise<RunningServer> {
  // bf16 and eager: a fast start (the default, --weights auto with the compiled step, measures and compiles first).
  return startServer(["-m", "kakeya_runtime.cli", "serve", "--model", model, "--weights", "bf16", "--no-compile",
    "--port", "0", "--no-metrics"]);
}

/** Run a Python snippet with the runtime's interpreter; resolves to its stdout. */
export async function runPython(code: string, stdin = ""): Promise<string> {
  const child = spawn(PYTHON, ["-c", code], { cwd: REPO_ROOT, stdio: ["pipe", "pipe", "pipe"] });
  let out = "";
  let err = "";
  child.stdout.on("data", (c: Buffer) => (out += c.toString()));
  child.stderr.on("data", (c: Buffer) => (err += c.toString()));
  child.stdin.end(stdin);
  const code_ = await new Promise<number | null>((res) => child.once("exit", res));
  if (code_ !== 0) throw new Error(`python exited with ${code_}: ${err.slice(-4000)}`);
  return out;
}
