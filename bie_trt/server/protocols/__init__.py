"""The wire formats of the three APIs: OpenAI (completions, chat), Anthropic Messages, OpenAI Responses."""
