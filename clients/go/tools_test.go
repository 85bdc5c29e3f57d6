package pdserve

import (
	"testing"

	pb "github.com/pdserve/pdserve/clients/go/gen/pdserve/v1"
)

func TestToolOptionsAndMergedCalls(t *testing.T) {
	req := ChatRequest([]*pb.ChatMessage{Message("user", "hi"), ToolResult("call_1", "3 C")},
		Tools(Tool("get_weather", "", `{"type": "object"}`)), ToolChoiceFunction("get_weather"), ParallelToolCalls(false))
	if len(req.Tools) != 1 || req.GetToolChoice().GetFunction() != "get_weather" || req.GetParallelToolCalls() {
		t.Fatalf("tool options not set: %v", req)
	}
	if req.Messages[1].ToolCallId != "call_1" || req.Messages[1].Role != "tool" {
		t.Fatalf("tool turn: %v", req.Messages[1])
	}
	calls := mergeToolCalls(nil, []*pb.ToolCallDelta{{Index: 0, Id: "a", Name: "f", Arguments: `{"x"`}})
	calls = mergeToolCalls(calls, []*pb.ToolCallDelta{{Index: 0, Arguments: `: 1}`}, {Index: 1, Id: "b", Name: "g"}})
	if len(calls) != 2 || calls[0].Arguments != `{"x": 1}` || calls[1].Name != "g" || calls[0].Id != "a" {
		t.Fatalf("merged calls: %v", calls)
	}
}
