"""The grounding guard: an NLI (or fallback) check that the answer is supported by the request."""
