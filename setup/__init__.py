"""One-off preparation scripts (environment, teacher checkpoint, corpora), run as `python -m setup.<name>`."""
