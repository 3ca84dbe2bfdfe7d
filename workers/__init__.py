"""Role-specific worker loops: prefill and decode, and the KV transfer between them."""
