"""Evaluation: tasks, perplexity through the cache, and fidelity of a method to fp16."""
