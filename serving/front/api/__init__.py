"""The HTTP front's pieces: request models, errors, routes (serving.front.http_server assembles
them)."""
