"""Data: built-in tasks that generate their own rows, and (later) loaders for local files."""
