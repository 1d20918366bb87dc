"""The real vLLM contract suite: a CPU build of vLLM serving SmolLM2-135M-Instruct, driven through the gateway."""
