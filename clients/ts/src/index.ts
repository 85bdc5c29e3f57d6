/**
 * TypeScript client of pdserve's public gRPC API (pdserve.v1.Generation, served by the router), over
 * @connectrpc/connect-node's gRPC transport (HTTP/2, no native modules).
 *
 *   const c = new PdserveClient("localhost:50051", { token, timeoutMs: 30_000 });
 *   const out = await c.generate(promptRequest("hello", { maxTokens: 32, temperature: 0 }));
 *   for await (const chunk of c.stream(req, { signal })) process.stdout.write(chunk.text);
 *   const names = await c.listModels(); // the served models; `{ model: name }` in a request picks one
 *
 * Metadata contract (docs/api.md): `authorization: Bearer <token>`, `x-priority: low|normal|high` (the request's
 * priority field wins), a W3C `traceparent` continued by the server's trace, the call's deadline (timeoutMs).
 * RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms` (or `retry-after-ms`) is retried after the pushback
 * (RetryPolicy); streams only before their first chunk. Cancel with an AbortSignal.
 */
import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Client } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { readFileSync } from "node:fs";
import {
  ChatMessageSchema,
  Generation,
  GenerateRequestSchema,
  SamplingParamsSchema,
  TokenIdsSchema,
  ToolChoiceMode,
  ToolChoiceSchema,
  ToolSchema,
  type GenerateRequest,
  type GenerateResponse,
  type GenerateStreamResponse,
  type SamplingParams,
} from "./gen/pdserve/v1/generate_pb.js";
import { DEFAULT_RETRY, retryDelayMs, type RetryPolicy } from "./retry.js";

export * from "./gen/pdserve/v1/generate_pb.js";
export * from "./retry.js";
export { Code, ConnectError } from "@connectrpc/connect";

export type Priority = "low" | "normal" | "high";

export interface ClientOptions {
  token?: string; // sent as `authorization: Bearer <token>`
  priority?: Priority; // `x-priority` on every call
  timeoutMs?: number; // default deadline of each call, retries included
  tlsCa?: string | Buffer; // PEM path or bytes: TLS verified against this CA
  tls?: boolean; // TLS with the system roots
  tlsCert?: string | Buffer; // PEM path or bytes: a client certificate (with tlsKey)
  tlsKey?: string | Buffer;
  retry?: RetryPolicy | false; // false: never retry
  headers?: Record<string, string>; // extra metadata on every call
}

export interface CallOptions {
  signal?: AbortSignal; // abort = cancel the call (the server stops generating and frees the KV pages)
  timeoutMs?: number;
  traceparent?: string; // W3C trace context: the server's spans join this trace
  headers?: Record<string, string>;
}

export type Sampling = Partial<Omit<SamplingParams, "$typeName" | "$unknown">>;

export interface RequestOptions extends Sampling {
  requestId?: string;
  model?: string; // the served model to run (listModels() names them; unset = the router's only model)
}

function request(opts: RequestOptions, input: MessageInitShape<typeof GenerateRequestSchema>): GenerateRequest {
  const { requestId, model, ...sampling } = opts;
  return create(GenerateRequestSchema, {
    ...input,
    requestId: requestId ?? "",
    model: model ?? "",
    sampling: create(SamplingParamsSchema, sampling),
  });
}

/** A completion of text (tokenized by the router). */
export function promptRequest(prompt: string, opts: RequestOptions = {}): GenerateRequest {
  return request(opts, { input: { case: "prompt", value: prompt } });
}

/** A completion of already tokenized input. */
export function tokenRequest(ids: number[], opts: RequestOptions = {}): GenerateRequest {
  return request(opts, { input: { case: "tokenIds", value: create(TokenIdsSchema, { ids }) } });
}

/** One chat turn: role and content; an assistant turn's `toolCalls`, a tool turn's `toolCallId`. */
export type ChatTurn = MessageInitShape<typeof ChatMessageSchema>;

/** Tool calling (chat requests): functions the model may call and whether / which one it must call. */
export interface ToolOptions {
  tools?: MessageInitShape<typeof ToolSchema>[]; // name, description, parameters (JSON Schema as JSON text)
  toolChoice?: "auto" | "none" | "required" | { function: string }; // required / a function: grammar-enforced
  parallelToolCalls?: boolean; // false: at most one call
}

const TOOL_MODES = { auto: ToolChoiceMode.AUTO, none: ToolChoiceMode.NONE, required: ToolChoiceMode.REQUIRED };

/** The assistant's next turn after `messages` (rendered with the model's chat template); its calls come back in
 * `toolCalls` (streamed as ToolCallDelta pieces: a call's id and name first, then its arguments). */
export function chatRequest(messages: ChatTurn[], opts: RequestOptions & ToolOptions = {}): GenerateRequest {
  const { tools, toolChoice, parallelToolCalls, ...rest } = opts;
  const choice =
    toolChoice === undefined
      ? undefined
      : create(ToolChoiceSchema, {
          choice:
            typeof toolChoice === "string"
              ? { case: "mode", value: TOOL_MODES[toolChoice] }
              : { case: "function", value: toolChoice.function },
        });
  return request(rest, {
    messages: messages.map((m) => create(ChatMessageSchema, m)),
    tools: (tools ?? []).map((t) => create(ToolSchema, t)),
    toolChoice: choice,
    parallelToolCalls,
  });
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(t);
      reject(new ConnectError("cancelled while waiting to retry", Code.Canceled));
    });
  });
}

export class PdserveClient {
  private readonly client: Client<typeof Generation>;
  private readonly headers: Record<string, string>;
  private readonly timeoutMs?: number;
  private readonly retry: RetryPolicy;
  retries = 0; // RESOURCE_EXHAUSTED retried so far (all calls)

  constructor(target: string, opts: ClientOptions = {}) {
    const pem = (v?: string | Buffer) => (typeof v === "string" ? readFileSync(v) : v);
    const [ca, cert, key] = [pem(opts.tlsCa), pem(opts.tlsCert), pem(opts.tlsKey)];
    if ((cert === undefined) !== (key === undefined)) throw new Error("tlsCert and tlsKey go together");
    const secure = opts.tls || ca !== undefined || cert !== undefined;
    const transport = createGrpcTransport({
      baseUrl: `${secure ? "https" : "http"}://${target}`,
      nodeOptions: { ca, cert, key },
      readMaxBytes: 64 << 20,
    });
    this.client = createClient(Generation, transport);
    this.headers = { ...opts.headers };
    if (opts.token) this.headers["authorization"] = `Bearer ${opts.token}`;
    if (opts.priority) this.headers["x-priority"] = opts.priority;
    this.timeoutMs = opts.timeoutMs;
    this.retry = opts.retry === false ? { ...DEFAULT_RETRY, maxAttempts: 1 } : (opts.retry ?? DEFAULT_RETRY);
  }

  private callHeaders(o: CallOptions): Record<string, string> {
    const h = { ...this.headers, ...o.headers };
    if (o.traceparent) h["traceparent"] = o.traceparent;
    return h;
  }

  /** Sleep before the next attempt and return the ms slept; rethrow `err` when the policy gives up. */
  private async backoff(err: unknown, attempt: number, waited: number, deadline: number | undefined, o: CallOptions) {
    const d = retryDelayMs(this.retry, ConnectError.from(err), attempt, waited, deadline);
    if (d === undefined) throw err;
    this.retries += 1;
    await sleep(d, o.signal);
    return d;
  }

  /** One request to completion; RESOURCE_EXHAUSTED with a pushback is retried. */
  async generate(req: GenerateRequest, o: CallOptions = {}): Promise<GenerateResponse> {
    const timeout = o.timeoutMs ?? this.timeoutMs;
    const deadline = timeout === undefined ? undefined : Date.now() + timeout;
    let waited = 0;
    for (let attempt = 1; ; attempt++) {
      try {
        const timeoutMs = deadline === undefined ? undefined : Math.max(1, deadline - Date.now());
        return await this.client.generate(req, { signal: o.signal, timeoutMs, headers: this.callHeaders(o) });
      } catch (err) {
        waited += await this.backoff(err, attempt, waited, deadline, o);
      }
    }
  }

  /** The names of the models the router serves (what `model` may name), sorted. */
  async listModels(o: CallOptions = {}): Promise<string[]> {
    const timeoutMs = o.timeoutMs ?? this.timeoutMs;
    const resp = await this.client.listModels({}, { signal: o.signal, timeoutMs, headers: this.callHeaders(o) });
    return resp.models.map((m) => m.name);
  }

  /** The chunks of a streamed completion; abort `o.signal` (or leave the loop) to cancel it. */
  async *stream(req: GenerateRequest, o: CallOptions = {}): AsyncGenerator<GenerateStreamResponse> {
    const timeout = o.timeoutMs ?? this.timeoutMs;
    const deadline = timeout === undefined ? undefined : Date.now() + timeout;
    let waited = 0;
    for (let attempt = 1; ; attempt++) {
      const abort = new AbortController();
      const onAbort = () => abort.abort(o.signal?.reason);
      o.signal?.addEventListener("abort", onAbort);
      let yielded = false;
      try {
        const timeoutMs = deadline === undefined ? undefined : Math.max(1, deadline - Date.now());
        const call = this.client.generateStream(req, { signal: abort.signal, timeoutMs, headers: this.callHeaders(o) });
        for await (const msg of call) {
          yielded = true;
          yield msg;
        }
        return;
      } catch (err) {
        if (yielded) throw err; // tokens reached the caller: a retry would repeat them
        waited += await this.backoff(err, attempt, waited, deadline, o);
      } finally {
        o.signal?.removeEventListener("abort", onAbort);
        abort.abort(); // no-op when finished; stops generation when the caller leaves the loop early
      }
    }
  }
}
