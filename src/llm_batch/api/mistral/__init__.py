"""Mistral's dialect: batch jobs, with Mistral's words."""
