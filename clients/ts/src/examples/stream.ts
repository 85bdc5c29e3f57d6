// Streams a completion: node dist/examples/stream.js [host:port] [prompt...] (token: $PDSERVE_TOKEN).
import { PdserveClient, promptRequest } from "../index.js";

const [target = "localhost:50051", ...words] = process.argv.slice(2);
const client = new PdserveClient(target, { token: process.env.PDSERVE_TOKEN, timeoutMs: 60_000 });
const abort = new AbortController();
process.on("SIGINT", () => abort.abort()); // Ctrl-C cancels the generation
const req = promptRequest(words.join(" ") || "Once upon a time", { maxTokens: 64 });
for await (const chunk of client.stream(req, { signal: abort.signal })) {
  process.stdout.write(chunk.text);
  if (chunk.usage && chunk.finishReason) console.log(`\n[${chunk.usage.completionTokens} tokens]`);
}
