"""The replica's OpenAI-compatible HTTP API: completions, chat, streaming."""
