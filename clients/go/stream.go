package pdserve

import (
	"context"
	"io"
	"time"

	pb "github.com/pdserve/pdserve/clients/go/gen/pdserve/v1"
	"google.golang.org/grpc/metadata"
)

// Stream iterates over the chunks of a streamed completion:
//
//	for { chunk, err := s.Next(); if err == io.EOF { break } ... }
//
// Close (or cancelling the context given to Client.Stream) cancels the call, and the server stops generating
// and frees the request's KV pages.
type Stream struct {
	client   *Client
	ctx      context.Context
	cancel   context.CancelFunc
	req      *pb.GenerateRequest
	call     pb.Generation_GenerateStreamClient
	received bool // a chunk reached the caller: no more retries (they would repeat tokens)
}

// Stream starts a streamed completion. Errors of the call (a rejection, a bad request) come from Next.
func (c *Client) Stream(ctx context.Context, req *pb.GenerateRequest) (*Stream, error) {
	ctx, cancel := c.callContext(ctx)
	s := &Stream{client: c, ctx: ctx, cancel: cancel, req: req}
	if err := s.open(); err != nil {
		cancel()
		return nil, err
	}
	return s, nil
}

func (s *Stream) open() error {
	call, err := s.client.stub.GenerateStream(s.ctx, s.req)
	s.call = call
	return err
}

// Next returns the next chunk; io.EOF after the last one (the chunk with a finish_reason). RESOURCE_EXHAUSTED with a
// pushback before the first chunk is retried per the client's RetryPolicy.
func (s *Stream) Next() (*pb.GenerateStreamResponse, error) {
	var waited time.Duration
	for attempt := 1; ; attempt++ {
		msg, err := s.call.Recv()
		if err == nil {
			s.received = true
			return msg, nil
		}
		if err == io.EOF || s.received {
			s.cancel()
			return nil, err
		}
		var trailer metadata.MD = s.call.Trailer()
		d, ok := s.client.opts.retry.Delay(s.ctx, err, trailer, attempt, waited)
		if !ok {
			s.cancel()
			return nil, err
		}
		if err := sleep(s.ctx, d); err != nil {
			return nil, err
		}
		waited += d
		if err := s.open(); err != nil {
			s.cancel()
			return nil, err
		}
	}
}

// Close cancels the call (a no-op after the last chunk).
func (s *Stream) Close() { s.cancel() }

// Collect reads the rest of the stream into one response (token ids and text concatenated, tool call pieces
// joined, the last chunk's finish reason and usage).
func (s *Stream) Collect() (*pb.GenerateResponse, error) {
	out := &pb.GenerateResponse{}
	for {
		chunk, err := s.Next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out.RequestId = chunk.RequestId
		out.TokenIds = append(out.TokenIds, chunk.TokenIds...)
		out.Text += chunk.Text
		out.ReasoningText += chunk.ReasoningText
		out.Logprobs = append(out.Logprobs, chunk.Logprobs...)
		out.ToolCalls = mergeToolCalls(out.ToolCalls, chunk.ToolCalls)
		if chunk.PromptLogprobs != nil {
			out.PromptLogprobs = chunk.PromptLogprobs
		}
		if chunk.FinishReason != pb.FinishReason_FINISH_REASON_UNSPECIFIED {
			out.FinishReason, out.StopReason, out.Usage, out.Timing = chunk.FinishReason, chunk.StopReason, chunk.Usage, chunk.Timing
		}
	}
}
