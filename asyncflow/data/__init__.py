"""Prompt datasets and synthetic task generators."""
