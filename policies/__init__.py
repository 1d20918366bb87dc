"""Policies: pre-request rewrites and refusals, stream filters, post-response verdicts."""
