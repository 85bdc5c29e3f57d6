/** The retry of RESOURCE_EXHAUSTED with a server pushback, as the Python SDK's pdserve.client_retry. */
import { Code, type ConnectError } from "@connectrpc/connect";

/** Trailers that name the retry delay in ms, gRPC's key first. */
export const PUSHBACK_KEYS = ["grpc-retry-pushback-ms", "retry-after-ms"] as const;

/** The n-th retry waits max(pushback, minDelayMs * backoff^(n-1) capped at maxDelayMs) plus up to `jitter` of itself,
 * within maxAttempts (the first try included), maxWaitMs of sleeps in total and the call's deadline. No pushback
 * (gRPC's own refusal, e.g. a message too large) or a negative one: no retry. */
export interface RetryPolicy {
  maxAttempts: number;
  maxWaitMs: number;
  minDelayMs: number;
  backoff: number;
  maxDelayMs: number;
  jitter: number;
}

export const DEFAULT_RETRY: RetryPolicy = {
  maxAttempts: 64,
  maxWaitMs: 20_000,
  minDelayMs: 50,
  backoff: 1.5,
  maxDelayMs: 2_000,
  jitter: 0.2,
};

/** The server's delay in ms: undefined when it sent none, -1 when it asked for no retry. */
export function pushbackMs(err: ConnectError): number | undefined {
  for (const key of PUSHBACK_KEYS) {
    const v = err.metadata.get(key);
    if (v !== null) {
      const ms = Number(v);
      return Number.isInteger(ms) && ms >= 0 ? ms : -1;
    }
  }
  return undefined;
}

/** Ms to sleep before attempt+1 after `err` ended `attempt` (1-based) having slept `waitedMs`; undefined: give up.
 * `deadline`: Date.now() the call must end by. */
export function retryDelayMs(
  p: RetryPolicy,
  err: ConnectError,
  attempt: number,
  waitedMs: number,
  deadline?: number,
): number | undefined {
  if (err.code !== Code.ResourceExhausted || attempt >= p.maxAttempts) return undefined;
  const push = pushbackMs(err);
  if (push === undefined || push < 0) return undefined;
  const floor = Math.min(p.maxDelayMs, p.minDelayMs * p.backoff ** (attempt - 1));
  const d = Math.max(floor, push) * (1 + p.jitter * Math.random());
  if (waitedMs + d > p.maxWaitMs) return undefined;
  if (deadline !== undefined && Date.now() + d >= deadline) return undefined;
  return d;
}
