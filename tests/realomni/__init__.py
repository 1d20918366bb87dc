"""The real vLLM-Omni suite (`make test-omni`): a CPU vLLM-Omni serving a tiny Qwen3-Omni, behind the gateway."""
