package pdserve

import "testing"

func TestModelOptionNamesTheServedModel(t *testing.T) {
	req := PromptRequest("hi", Model("qwen-0.5b"), MaxTokens(4))
	if req.Model != "qwen-0.5b" || req.GetSampling().GetMaxTokens() != 4 {
		t.Fatalf("model option not set: %v", req)
	}
	if PromptRequest("hi").Model != "" {
		t.Fatal("no Model option must leave the model empty (the router's only model)")
	}
}
