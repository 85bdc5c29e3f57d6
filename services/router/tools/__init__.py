"""Tool calls (OpenAI tools / tool_choice): rendering, the grammar that enforces calls, and parsing them out."""
