"""Speculative decoding: acceptance (pure), drafters (one per file), the session."""
