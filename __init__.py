"""rollfleet: the inference side of LLM reinforcement learning, without Ray."""
