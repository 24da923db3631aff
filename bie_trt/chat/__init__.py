"""Text around the model: the tokenizer, chat templates, tool calls and reasoning. No tensors; the executor
and the server build on it."""
