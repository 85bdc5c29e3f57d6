package pdserve

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

func TestPushbackPrefersGRPCKeyAndHonoursDoNotRetry(t *testing.T) {
	cases := []struct {
		md   metadata.MD
		want time.Duration
		ok   bool
	}{
		{metadata.Pairs("grpc-retry-pushback-ms", "250", "retry-after-ms", "900"), 250 * time.Millisecond, true},
		{metadata.Pairs("retry-after-ms", "900"), 900 * time.Millisecond, true},
		{metadata.MD{}, 0, false},
		{metadata.Pairs("grpc-retry-pushback-ms", "-1"), -1, true},
		{metadata.Pairs("grpc-retry-pushback-ms", "soon"), -1, true},
	}
	for _, c := range cases {
		if got, ok := Pushback(c.md); got != c.want || ok != c.ok {
			t.Errorf("Pushback(%v) = %v, %v; want %v, %v", c.md, got, ok, c.want, c.ok)
		}
	}
}

func TestDelayFollowsPushbackWithinBounds(t *testing.T) {
	p := RetryPolicy{MaxAttempts: 4, MaxWait: time.Second, MinDelay: 50 * time.Millisecond, Backoff: 1.5,
		MaxDelay: 2 * time.Second}
	busy := status.Error(codes.ResourceExhausted, "busy")
	push := metadata.Pairs("grpc-retry-pushback-ms", "300")
	ctx := context.Background()
	if d, ok := p.Delay(ctx, busy, push, 1, 0); !ok || d != 300*time.Millisecond {
		t.Fatalf("first retry: %v %v", d, ok)
	}
	if _, ok := p.Delay(ctx, busy, push, 4, 0); ok {
		t.Fatal("retried past MaxAttempts")
	}
	if _, ok := p.Delay(ctx, busy, push, 2, 800*time.Millisecond); ok {
		t.Fatal("slept past MaxWait")
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if _, ok := p.Delay(short, busy, push, 1, 0); ok {
		t.Fatal("slept past the deadline")
	}
	if _, ok := p.Delay(ctx, busy, metadata.MD{}, 1, 0); ok {
		t.Fatal("retried without a pushback")
	}
	for _, err := range []error{status.Error(codes.Unavailable, ""), status.Error(codes.InvalidArgument, ""), errors.New("x")} {
		if _, ok := p.Delay(ctx, err, push, 1, 0); ok {
			t.Fatalf("retried %v", err)
		}
	}
	if d, ok := p.Delay(ctx, busy, metadata.Pairs("grpc-retry-pushback-ms", "1"), 3, 0); !ok || d != 112500*time.Microsecond {
		t.Fatalf("a small pushback is floored by the backoff: %v", d) // 50ms * 1.5^2
	}
}
