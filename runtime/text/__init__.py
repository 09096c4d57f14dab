"""The prompt side: the text encoder's embeddings, and the prompt enhancer (local, or on a chat endpoint) with its
token sampler and static-cache decoder."""
