"""The kernel: what every layer imports and which imports nothing of the project."""
