"""OpenAI's Realtime protocol over the omni chat engine: session state, server VAD, event models, the turn runner."""
