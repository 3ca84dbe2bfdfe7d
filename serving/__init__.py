"""The engine both worker roles share: config, model, memory, scheduling, HTTP front."""
