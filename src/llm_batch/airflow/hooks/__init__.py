"""Hooks of the provider."""
