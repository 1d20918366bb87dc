"""Guard models served by engines: an HTTP client for vLLM's and TEI's pooling endpoints, micro-batched."""
