// pdserve-go streams a completion from a pdserve router:
//
//	pdserve-go -target localhost:50051 -token $PDSERVE_TOKEN -max-tokens 64 "Once upon a time"
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"time"

	pdserve "github.com/pdserve/pdserve/clients/go"
)

func main() {
	target := flag.String("target", "localhost:50051", "router host:port")
	token := flag.String("token", os.Getenv("PDSERVE_TOKEN"), "bearer token (default $PDSERVE_TOKEN)")
	ca := flag.String("tls-ca", "", "PEM CA file: use TLS")
	maxTokens := flag.Int("max-tokens", 64, "completion length cap")
	timeout := flag.Duration("timeout", 60*time.Second, "deadline of the call")
	flag.Parse()

	opts := []pdserve.Option{pdserve.WithToken(*token), pdserve.WithTimeout(*timeout)}
	if *ca != "" {
		opts = append(opts, pdserve.WithTLS(*ca))
	}
	c, err := pdserve.Dial(*target, opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer c.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt) // Ctrl-C cancels the generation
	defer stop()
	s, err := c.Stream(ctx, pdserve.PromptRequest(strings.Join(flag.Args(), " "), pdserve.MaxTokens(int32(*maxTokens))))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer s.Close()
	for {
		chunk, err := s.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "\n", err)
			os.Exit(1)
		}
		fmt.Print(chunk.Text)
		if chunk.Usage != nil && chunk.FinishReason != 0 {
			fmt.Printf("\n[%s, %d tokens]\n", chunk.FinishReason, chunk.Usage.CompletionTokens)
		}
	}
}
