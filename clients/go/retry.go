package pdserve

import (
	"context"
	"math"
	"math/rand"
	"strconv"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// PushbackKeys are the trailers a RESOURCE_EXHAUSTED names its retry delay in (milliseconds), gRPC's key first.
var PushbackKeys = []string{"grpc-retry-pushback-ms", "retry-after-ms"}

// RetryPolicy retries RESOURCE_EXHAUSTED that carries a pushback (the router at capacity), as the Python SDK does
// (pdserve.client_retry): the n-th retry waits max(pushback, MinDelay*Backoff^(n-1) capped at MaxDelay) plus up to
// Jitter of itself, within MaxAttempts (the first try included), MaxWait of sleeps in total and the call's
// deadline. Without a pushback (gRPC's own refusal, e.g. a message too large) or with a negative one, no retry.
type RetryPolicy struct {
	MaxAttempts int
	MaxWait     time.Duration
	MinDelay    time.Duration
	Backoff     float64
	MaxDelay    time.Duration
	Jitter      float64
}

// DefaultRetryPolicy is the Python SDK's RetryPolicy().
func DefaultRetryPolicy() RetryPolicy {
	return RetryPolicy{MaxAttempts: 64, MaxWait: 20 * time.Second, MinDelay: 50 * time.Millisecond, Backoff: 1.5,
		MaxDelay: 2 * time.Second, Jitter: 0.2}
}

// NoRetry never retries.
var NoRetry = RetryPolicy{MaxAttempts: 1}

// Pushback is the server's retry delay from trailer: ok=false when it sent none, d<0 when it asked for no retry.
func Pushback(trailer metadata.MD) (d time.Duration, ok bool) {
	for _, key := range PushbackKeys {
		if v := trailer.Get(key); len(v) > 0 {
			ms, err := strconv.ParseInt(v[0], 10, 64)
			if err != nil || ms < 0 {
				return -1, true
			}
			return time.Duration(ms) * time.Millisecond, true
		}
	}
	return 0, false
}

// Delay is how long to sleep before attempt+1 after err (with trailer) ended attempt (1-based), having slept
// waited already; ok=false: give up and return err.
func (p RetryPolicy) Delay(ctx context.Context, err error, trailer metadata.MD, attempt int, waited time.Duration) (time.Duration, bool) {
	if status.Code(err) != codes.ResourceExhausted || attempt >= p.MaxAttempts {
		return 0, false
	}
	push, ok := Pushback(trailer)
	if !ok || push < 0 {
		return 0, false
	}
	floor := time.Duration(math.Min(float64(p.MaxDelay), float64(p.MinDelay)*math.Pow(p.Backoff, float64(attempt-1))))
	base := push
	if floor > base {
		base = floor
	}
	d := time.Duration(float64(base) * (1 + p.Jitter*rand.Float64()))
	if waited+d > p.MaxWait {
		return 0, false
	}
	if deadline, has := ctx.Deadline(); has && time.Now().Add(d).After(deadline) {
		return 0, false
	}
	return d, true
}
