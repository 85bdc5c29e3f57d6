package pdserve

import pb "github.com/pdserve/pdserve/clients/go/gen/pdserve/v1"

// Tool is a function the model may call; parameters is its arguments' JSON Schema as JSON text ("" = any object).
func Tool(name, description, parameters string) *pb.Tool {
	return &pb.Tool{Name: name, Description: description, Parameters: parameters}
}

// Tools offers functions to the model (chat requests): the router renders them with the model's chat template and
// parses its calls into GenerateResponse.ToolCalls (streamed as ToolCallDelta pieces).
func Tools(tools ...*pb.Tool) RequestOption {
	return func(r *pb.GenerateRequest) { r.Tools = append(r.Tools, tools...) }
}

// ToolChoice sets auto, none or required (required: one or more calls, enforced by the grammar engine).
func ToolChoice(mode pb.ToolChoiceMode) RequestOption {
	return func(r *pb.GenerateRequest) {
		r.ToolChoice = &pb.ToolChoice{Choice: &pb.ToolChoice_Mode{Mode: mode}}
	}
}

// ToolChoiceFunction makes the model call exactly this tool (enforced by the grammar engine).
func ToolChoiceFunction(name string) RequestOption {
	return func(r *pb.GenerateRequest) {
		r.ToolChoice = &pb.ToolChoice{Choice: &pb.ToolChoice_Function{Function: name}}
	}
}

// ParallelToolCalls false allows at most one call per response.
func ParallelToolCalls(on bool) RequestOption {
	return func(r *pb.GenerateRequest) { r.ParallelToolCalls = &on }
}

// AssistantCalls is an assistant turn of the history that made these calls.
func AssistantCalls(content string, calls ...*pb.ToolCall) *pb.ChatMessage {
	return &pb.ChatMessage{Role: "assistant", Content: content, ToolCalls: calls}
}

// ToolResult is a tool turn: the result of the call callID.
func ToolResult(callID, content string) *pb.ChatMessage {
	return &pb.ChatMessage{Role: "tool", Content: content, ToolCallId: callID}
}

// mergeToolCalls appends a chunk's call pieces to calls (a call's first piece has its id and name).
func mergeToolCalls(calls []*pb.ToolCall, deltas []*pb.ToolCallDelta) []*pb.ToolCall {
	for _, d := range deltas {
		for int(d.Index) >= len(calls) {
			calls = append(calls, &pb.ToolCall{})
		}
		c := calls[d.Index]
		if d.Id != "" {
			c.Id, c.Name = d.Id, d.Name
		}
		c.Arguments += d.Arguments
	}
	return calls
}
