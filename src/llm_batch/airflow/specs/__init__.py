"""Kubernetes objects of shard workers and engine services, from a ShardTask and the settings."""
