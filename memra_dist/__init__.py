"""memra_dist: speculative-decoding LLM inference split across GPUs, every phase traced."""

__version__ = "0.1.0"
