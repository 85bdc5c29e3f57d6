// Package pdserve is the Go client of pdserve's public gRPC API (pdserve.v1.Generation, served by the router).
//
//	c, err := pdserve.Dial("localhost:50051", pdserve.WithToken(tok), pdserve.WithTimeout(30*time.Second))
//	resp, err := c.Generate(ctx, pdserve.PromptRequest("hello", pdserve.MaxTokens(32), pdserve.Greedy()))
//	s, err := c.Stream(ctx, req) // then s.Next() until io.EOF; cancel ctx (or s.Close()) to stop generation
//	names, err := c.ListModels(ctx) // the served models; pdserve.Model(name) picks one for a request
//
// The metadata contract (docs/api.md): `authorization: Bearer <token>`, `x-priority: low|normal|high` (the request's
// priority field wins), a W3C `traceparent` continued by the server's trace, and the call's deadline. RESOURCE_EXHAUSTED
// with `grpc-retry-pushback-ms` (or `retry-after-ms`) is retried after the pushback (RetryPolicy); streams only
// before their first chunk.
package pdserve

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"time"

	pb "github.com/pdserve/pdserve/clients/go/gen/pdserve/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
)

// Metadata keys of the public API.
const (
	AuthorizationKey = "authorization"
	PriorityKey      = "x-priority"
	TraceparentKey   = "traceparent"
)

type options struct {
	token    string
	priority string
	timeout  time.Duration
	tlsConf  *tls.Config
	retry    RetryPolicy
	metadata []string // key, value pairs sent on every call
	dial     []grpc.DialOption
}

// Option configures a Client.
type Option func(*options) error

// WithToken sends `authorization: Bearer <token>` on every call (the router maps it to a tenant).
func WithToken(token string) Option {
	return func(o *options) error { o.token = token; return nil }
}

// WithPriority sends `x-priority` (low, normal or high) on every call; a request's own priority field wins.
func WithPriority(priority string) Option {
	return func(o *options) error {
		switch priority {
		case "low", "normal", "high":
			o.priority = priority
			return nil
		}
		return fmt.Errorf("pdserve: priority must be low, normal or high, not %q", priority)
	}
}

// WithTimeout is the default deadline of each call, retries included (a context deadline that is sooner wins).
func WithTimeout(d time.Duration) Option {
	return func(o *options) error { o.timeout = d; return nil }
}

// WithTLS makes the channel TLS, verified against the PEM CA bundle at caFile ("" = the system roots).
func WithTLS(caFile string) Option {
	return func(o *options) error {
		conf := &tls.Config{MinVersion: tls.VersionTLS12}
		if caFile != "" {
			pem, err := os.ReadFile(caFile)
			if err != nil {
				return fmt.Errorf("pdserve: reading CA file: %w", err)
			}
			conf.RootCAs = x509.NewCertPool()
			if !conf.RootCAs.AppendCertsFromPEM(pem) {
				return fmt.Errorf("pdserve: no PEM certificate in %s", caFile)
			}
		}
		o.tlsConf = conf
		return nil
	}
}

// WithTLSConfig makes the channel TLS with a config of your own (client certificates, pinned roots).
func WithTLSConfig(conf *tls.Config) Option {
	return func(o *options) error { o.tlsConf = conf; return nil }
}

// WithRetry replaces the default RetryPolicy (NoRetry turns retries off).
func WithRetry(p RetryPolicy) Option {
	return func(o *options) error { o.retry = p; return nil }
}

// WithMetadata sends key: value on every call.
func WithMetadata(key, value string) Option {
	return func(o *options) error { o.metadata = append(o.metadata, key, value); return nil }
}

// WithDialOptions adds grpc.DialOptions (interceptors, keepalive, ...).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) error { o.dial = append(o.dial, opts...); return nil }
}

// WithTraceparent returns ctx carrying a W3C traceparent for the calls made with it: the router continues that
// trace (router -> decode -> prefill spans). Pass your own span's traceparent to join the caller's trace.
func WithTraceparent(ctx context.Context, traceparent string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, TraceparentKey, traceparent)
}

// Client calls the router's Generation service. It is safe for concurrent use; Close releases the connection.
type Client struct {
	conn *grpc.ClientConn
	stub pb.GenerationClient
	opts options
}

// Dial connects to the router at target (host:port); the connection is made lazily, as grpc.Dial does.
func Dial(target string, opts ...Option) (*Client, error) {
	o := options{retry: DefaultRetryPolicy()}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	dial := []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.ForceCodec(codec{}))}
	if o.tlsConf != nil {
		dial = append(dial, grpc.WithTransportCredentials(credentials.NewTLS(o.tlsConf)))
	} else {
		dial = append(dial, grpc.WithInsecure()) //nolint:staticcheck // plaintext loopback / in-cluster use
	}
	conn, err := grpc.Dial(target, append(dial, o.dial...)...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, stub: pb.NewGenerationClient(conn), opts: o}, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// callContext adds the client's metadata and default deadline to ctx.
func (c *Client) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	kv := append([]string(nil), c.opts.metadata...)
	if c.opts.token != "" {
		kv = append(kv, AuthorizationKey, "Bearer "+c.opts.token)
	}
	if c.opts.priority != "" {
		kv = append(kv, PriorityKey, c.opts.priority)
	}
	if len(kv) > 0 {
		ctx = metadata.AppendToOutgoingContext(ctx, kv...)
	}
	if c.opts.timeout > 0 {
		return context.WithTimeout(ctx, c.opts.timeout)
	}
	return context.WithCancel(ctx)
}

// Generate runs one request to completion; RESOURCE_EXHAUSTED with a pushback is retried (the client's policy).
func (c *Client) Generate(ctx context.Context, req *pb.GenerateRequest) (*pb.GenerateResponse, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	var waited time.Duration
	for attempt := 1; ; attempt++ {
		var trailer metadata.MD
		resp, err := c.stub.Generate(ctx, req, grpc.Trailer(&trailer))
		if err == nil {
			return resp, nil
		}
		d, ok := c.opts.retry.Delay(ctx, err, trailer, attempt, waited)
		if !ok {
			return nil, err
		}
		if err := sleep(ctx, d); err != nil {
			return nil, err
		}
		waited += d
	}
}

// ListModels returns the names of the models the router serves (what Model may name), sorted.
func (c *Client) ListModels(ctx context.Context) ([]string, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.stub.ListModels(ctx, &pb.ListModelsRequest{})
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(resp.Models))
	for _, m := range resp.Models {
		names = append(names, m.Name)
	}
	return names, nil
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
