// pdserve-contract runs the SDK behaviour contract (tests/clients/test_contract.py) against a live stack: it
// reads a JSON spec on stdin and prints one JSON object of what each scenario observed.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"
	"time"

	pdserve "github.com/pdserve/pdserve/clients/go"
	pb "github.com/pdserve/pdserve/clients/go/gen/pdserve/v1"
	"google.golang.org/grpc/status"
)

type spec struct {
	Target      string              `json:"target"`
	RetryTarget string              `json:"retry_target"`
	Token       string              `json:"token"`
	BadToken    string              `json:"bad_token"`
	PromptIDs   []int32             `json:"prompt_ids"`
	MaxTokens   int32               `json:"max_tokens"`
	LongTokens  int32               `json:"long_tokens"`
	Messages    []map[string]string `json:"messages"`
	TopLogprobs int32               `json:"top_logprobs"`
	Traceparent string              `json:"traceparent"`
	Model       string              `json:"model"`
	BadModel    string              `json:"bad_model"`
}

type logprob struct {
	TokenID int32   `json:"token_id"`
	Logprob float32 `json:"logprob"`
	Top     []int32 `json:"top_ids"`
}

var camel = regexp.MustCompile(`([a-z])([A-Z])`)

// codeName is the canonical status name (DEADLINE_EXCEEDED), as the other languages print it.
func codeName(err error) string {
	if err == nil {
		return "OK"
	}
	return strings.ToUpper(camel.ReplaceAllString(status.Code(err).String(), "${1}_${2}"))
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "contract:", err)
		os.Exit(1)
	}
}

func main() {
	var sp spec
	must(json.NewDecoder(os.Stdin).Decode(&sp))
	ctx := pdserve.WithTraceparent(context.Background(), sp.Traceparent)
	c, err := pdserve.Dial(sp.Target, pdserve.WithToken(sp.Token), pdserve.WithTimeout(120*time.Second))
	must(err)
	defer c.Close()
	out := map[string]any{}

	greedy := func(id string, opts ...pdserve.RequestOption) *pb.GenerateRequest {
		return pdserve.TokenRequest(sp.PromptIDs, append([]pdserve.RequestOption{pdserve.MaxTokens(sp.MaxTokens),
			pdserve.Greedy(), pdserve.IgnoreEOS(), pdserve.RequestID(id)}, opts...)...)
	}
	resp, err := c.Generate(ctx, greedy("go-greedy", pdserve.Model(sp.Model)))
	must(err)
	out["greedy"] = resp.TokenIds

	models, err := c.ListModels(ctx)
	must(err)
	out["models"] = models
	_, err = c.Generate(ctx, greedy("go-bad-model", pdserve.Model(sp.BadModel)))
	out["unknown_model"] = codeName(err)

	s, err := c.Stream(ctx, greedy("go-stream"))
	must(err)
	streamed, err := s.Collect()
	must(err)
	out["stream_greedy"] = streamed.TokenIds

	dctx, dcancel := context.WithTimeout(ctx, 1*time.Millisecond)
	_, err = c.Generate(dctx, pdserve.TokenRequest(sp.PromptIDs, pdserve.MaxTokens(sp.LongTokens), pdserve.IgnoreEOS()))
	dcancel()
	out["deadline"] = codeName(err)

	rc, err := pdserve.Dial(sp.RetryTarget, pdserve.WithToken(sp.Token))
	must(err)
	resp, err = rc.Generate(ctx, greedy("go-retry"))
	must(err)
	out["retry"] = resp.TokenIds
	rs, err := rc.Stream(ctx, greedy("go-retry-stream"))
	must(err)
	streamed, err = rs.Collect()
	must(err)
	out["retry_stream"] = streamed.TokenIds
	rc.Close()

	for key, token := range map[string]string{"unauthenticated": "", "wrong_token": sp.BadToken} {
		bad, err := pdserve.Dial(sp.Target, pdserve.WithToken(token))
		must(err)
		_, err = bad.Generate(ctx, greedy("go-"+key))
		out[key] = codeName(err)
		bad.Close()
	}

	msgs := make([]*pb.ChatMessage, 0, len(sp.Messages))
	for _, m := range sp.Messages {
		msgs = append(msgs, pdserve.Message(m["role"], m["content"]))
	}
	resp, err = c.Generate(ctx, pdserve.ChatRequest(msgs, pdserve.MaxTokens(sp.MaxTokens), pdserve.Greedy(),
		pdserve.Logprobs(sp.TopLogprobs), pdserve.IgnoreEOS()))
	must(err)
	lps := []logprob{}
	for _, lp := range resp.Logprobs {
		top := []int32{}
		for _, t := range lp.Top {
			top = append(top, t.TokenId)
		}
		lps = append(lps, logprob{lp.TokenId, lp.Logprob, top})
	}
	out["chat"] = map[string]any{"token_ids": resp.TokenIds, "text": resp.Text, "logprobs": lps}
	// last: cancel after 3 tokens (cancelling the context stops the call); the test then sees the pools empty
	cctx, cancel := context.WithCancel(ctx)
	s, err = c.Stream(cctx, pdserve.TokenRequest(sp.PromptIDs, pdserve.MaxTokens(sp.LongTokens), pdserve.IgnoreEOS(),
		pdserve.RequestID("go-cancel")))
	must(err)
	got := 0
	for got < 3 {
		chunk, err := s.Next()
		must(err)
		got += len(chunk.TokenIds)
	}
	cancel()
	for err == nil { // chunks already received may still come; then the call ends with Canceled
		_, err = s.Next()
	}
	out["cancel"] = map[string]any{"received": got, "after_cancel": codeName(err)}

	must(json.NewEncoder(os.Stdout).Encode(out))
}
