"""OpenAI-compatible router in front of prefill and decode workers (speaks HTTP only)."""
