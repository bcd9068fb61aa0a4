"""The GPU/CPU worker: Redis consumer, engine (scheduler, block manager, model
runner, sampler, detokenizer), gateway link client, health and metrics."""
