"""The HTTP front's pieces: request models, errors, routes (assembled by serving.http_server)."""
