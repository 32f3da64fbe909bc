"""sitsd: an LLM inference daemon (paged KV cache, continuous batching, gRPC API)."""

__version__ = "0.1.0"
