"""Peer systems run on the same model file, prompts, output lengths, dtype and cores."""
