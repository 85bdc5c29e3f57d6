package pdserve

import (
	"fmt"

	"google.golang.org/protobuf/proto"
)

// codec marshals with google.golang.org/protobuf (the generated code's API). gRPC-Go releases before 1.35, as
// Debian bookworm's 1.33, marshal through github.com/golang/protobuf, whose 1.3 release cannot encode these
// messages; forcing this codec makes the client work with either.
type codec struct{}

func (codec) Marshal(v interface{}) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("pdserve: cannot marshal %T", v)
	}
	return proto.Marshal(m)
}

func (codec) Unmarshal(data []byte, v interface{}) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("pdserve: cannot unmarshal into %T", v)
	}
	return proto.Unmarshal(data, m)
}

func (codec) Name() string { return "proto" }
