"""OpenAI-compatible HTTP gateway in front of the router (`pdserve serve gateway --router HOST:PORT`):
`/v1/models`, `/v1/completions`, `/v1/chat/completions` (SSE streaming), `/health`, `/ready`."""
