// The SDK behaviour contract (tests/clients/test_contract.py) against a live stack: reads a JSON spec on stdin,
// prints one JSON object of what each scenario observed (the Go and Python runs print the same shape).
import { text } from "node:stream/consumers";
import { ConnectError, PdserveClient, chatRequest, tokenRequest, type GenerateStreamResponse } from "../index.js";

interface Spec {
  target: string;
  retry_target: string;
  token: string;
  bad_token: string;
  prompt_ids: number[];
  max_tokens: number;
  long_tokens: number;
  messages: { role: string; content: string }[];
  top_logprobs: number;
  traceparent: string;
  model: string;
  bad_model: string;
}

/** The canonical status name (DEADLINE_EXCEEDED) of an error, OK for none. */
function codeName(err: unknown): string {
  if (err === undefined) return "OK";
  return codeKey(ConnectError.from(err).code).replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase();
}

function codeKey(code: number): string {
  const names = ["Ok", "Canceled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists",
    "PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
    "Internal", "Unavailable", "DataLoss", "Unauthenticated"];
  return names[code] ?? `Code${code}`;
}

async function failure(p: Promise<unknown>): Promise<string> {
  try {
    await p;
    return "OK";
  } catch (err) {
    return codeName(err);
  }
}

async function collect(it: AsyncIterable<GenerateStreamResponse>): Promise<number[]> {
  const ids: number[] = [];
  for await (const chunk of it) ids.push(...chunk.tokenIds);
  return ids;
}

const sp: Spec = JSON.parse(await text(process.stdin));
const call = { traceparent: sp.traceparent };
const c = new PdserveClient(sp.target, { token: sp.token, timeoutMs: 120_000 });
const greedy = (requestId: string, model?: string) =>
  tokenRequest(sp.prompt_ids, { maxTokens: sp.max_tokens, temperature: 0, ignoreEos: true, requestId, model });
const out: Record<string, unknown> = {};

out.greedy = (await c.generate(greedy("ts-greedy", sp.model), call)).tokenIds;
out.models = await c.listModels(call);
out.unknown_model = await failure(c.generate(greedy("ts-bad-model", sp.bad_model), call));
out.stream_greedy = await collect(c.stream(greedy("ts-stream"), call));

const long = tokenRequest(sp.prompt_ids, { maxTokens: sp.long_tokens, ignoreEos: true });
out.deadline = await failure(c.generate(long, { ...call, timeoutMs: 1 }));

const rc = new PdserveClient(sp.retry_target, { token: sp.token });
out.retry = (await rc.generate(greedy("ts-retry"), call)).tokenIds;
out.retry_stream = await collect(rc.stream(greedy("ts-retry-stream"), call));

out.unauthenticated = await failure(new PdserveClient(sp.target).generate(greedy("ts-no-token"), call));
const bad = new PdserveClient(sp.target, { token: sp.bad_token });
out.wrong_token = await failure(bad.generate(greedy("ts-wrong-token"), call));

const chat = await c.generate(
  chatRequest(sp.messages, {
    maxTokens: sp.max_tokens,
    temperature: 0,
    logprobs: true,
    topLogprobs: sp.top_logprobs,
    ignoreEos: true,
  }),
  call,
);
out.chat = {
  token_ids: chat.tokenIds,
  text: chat.text,
  logprobs: chat.logprobs.map((lp) => ({ token_id: lp.tokenId, logprob: lp.logprob, top_ids: lp.top.map((t) => t.tokenId) })),
};
// last: cancel after 3 tokens (abort); the test then sees the pools empty
const abort = new AbortController();
let received = 0;
let afterCancel = "OK";
try {
  const longReq = tokenRequest(sp.prompt_ids, { maxTokens: sp.long_tokens, ignoreEos: true, requestId: "ts-cancel" });
  for await (const chunk of c.stream(longReq, { ...call, signal: abort.signal })) {
    received += chunk.tokenIds.length;
    if (received >= 3) abort.abort();
  }
} catch (err) {
  afterCancel = codeName(err);
}
out.cancel = { received, after_cancel: afterCancel };

console.log(JSON.stringify(out));
