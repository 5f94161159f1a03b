"""Helpers the tests share: tiny GGUF models, the session's real agents."""
