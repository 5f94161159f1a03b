"""Definitions, sources, GGUF fit and job rendering: what an operator wrote, checked."""
