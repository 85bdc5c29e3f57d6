package pdserve

import pb "github.com/pdserve/pdserve/clients/go/gen/pdserve/v1"

// RequestOption sets a field of a GenerateRequest (its SamplingParams is always present).
type RequestOption func(*pb.GenerateRequest)

func newRequest(opts []RequestOption) *pb.GenerateRequest {
	req := &pb.GenerateRequest{Sampling: &pb.SamplingParams{}}
	for _, o := range opts {
		o(req)
	}
	return req
}

// PromptRequest is a completion of text (tokenized by the router).
func PromptRequest(prompt string, opts ...RequestOption) *pb.GenerateRequest {
	req := newRequest(opts)
	req.Input = &pb.GenerateRequest_Prompt{Prompt: prompt}
	return req
}

// TokenRequest is a completion of already tokenized input.
func TokenRequest(ids []int32, opts ...RequestOption) *pb.GenerateRequest {
	req := newRequest(opts)
	req.Input = &pb.GenerateRequest_TokenIds{TokenIds: &pb.TokenIds{Ids: ids}}
	return req
}

// ChatRequest is the assistant's next turn after messages (rendered with the model's chat template).
func ChatRequest(messages []*pb.ChatMessage, opts ...RequestOption) *pb.GenerateRequest {
	req := newRequest(opts)
	req.Messages = messages
	return req
}

// Message is one chat turn (role: system, user, assistant or tool).
func Message(role, content string) *pb.ChatMessage {
	return &pb.ChatMessage{Role: role, Content: content}
}

// MaxTokens caps the completion length.
func MaxTokens(n int32) RequestOption {
	return func(r *pb.GenerateRequest) { r.Sampling.MaxTokens = &n }
}

// Temperature sets the sampling temperature (0 = greedy).
func Temperature(t float32) RequestOption {
	return func(r *pb.GenerateRequest) { r.Sampling.Temperature = &t }
}

// Greedy is Temperature(0).
func Greedy() RequestOption { return Temperature(0) }

// TopP sets nucleus sampling's mass.
func TopP(p float32) RequestOption { return func(r *pb.GenerateRequest) { r.Sampling.TopP = &p } }

// TopK samples among the k most likely tokens.
func TopK(k int32) RequestOption { return func(r *pb.GenerateRequest) { r.Sampling.TopK = &k } }

// Seed makes sampling reproducible.
func Seed(s uint64) RequestOption { return func(r *pb.GenerateRequest) { r.Sampling.Seed = &s } }

// Stop ends the completion at any of these strings (not included in the text).
func Stop(s ...string) RequestOption {
	return func(r *pb.GenerateRequest) { r.Sampling.Stop = append(r.Sampling.Stop, s...) }
}

// IgnoreEOS keeps generating past EOS.
func IgnoreEOS() RequestOption { return func(r *pb.GenerateRequest) { r.Sampling.IgnoreEos = true } }

// Logprobs asks for each generated token's log-probability and its top alternatives (0..20).
func Logprobs(top int32) RequestOption {
	return func(r *pb.GenerateRequest) { r.Sampling.Logprobs, r.Sampling.TopLogprobs = true, top }
}

// Priority sets the request's priority field (it wins over the x-priority metadata).
func Priority(p pb.Priority) RequestOption { return func(r *pb.GenerateRequest) { r.Priority = p } }

// Model names the served model to run (Client.ListModels lists them; unset = the router's only model). A model the
// router does not serve gives NOT_FOUND.
func Model(name string) RequestOption { return func(r *pb.GenerateRequest) { r.Model = name } }

// RequestID names the request (the router assigns one when empty).
func RequestID(id string) RequestOption { return func(r *pb.GenerateRequest) { r.RequestId = id } }
