"""OpenAI Files and Batch API, and Anthropic Message Batches, on top of async jobs."""
