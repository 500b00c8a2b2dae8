// Build step: copy the repository's proto (the one source of truth) into this package as proto/, which the client
// loads at run time, and generate its TypeScript types into src/gen/ with @grpc/proto-loader's generator.
// Both outputs are gitignored build products: never edit them.
import { execFileSync } from "node:child_process";
import { cpSync, existsSync, mkdirSync, rmSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const PROTO_FILE = "kakeya/v1/runtime.proto";
const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const source = resolve(root, "../../proto", PROTO_FILE);
const target = join(root, "proto", PROTO_FILE);
if (!existsSync(source)) throw new Error(`${source} is missing: the SDK is built inside the repository`);
rmSync(join(root, "proto"), { recursive: true, force: true });
mkdirSync(dirname(target), { recursive: true });
cpSync(source, target);

// The flags must match LOADER_OPTIONS in src/rpc.ts: the types describe what the loader produces.
const generator = createRequire(import.meta.url).resolve("@grpc/proto-loader/build/bin/proto-loader-gen-types.js");
rmSync(join(root, "src", "gen"), { recursive: true, force: true });
execFileSync(process.execPath, [
  generator, PROTO_FILE, "--longs=String", "--enums=String", "--defaults", "--oneofs", "--includeComments",
  "--grpcLib=@grpc/grpc-js", "--importFileExtension=.js", "--outDir=src/gen", "--includeDirs=proto",
], { cwd: root, stdio: "inherit" });
