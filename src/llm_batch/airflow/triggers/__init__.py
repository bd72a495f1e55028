"""Triggers of the provider."""
