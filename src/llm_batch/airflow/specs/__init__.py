"""Kubernetes objects of a shard worker and an engine service, built from a ShardTask and the
settings (no Airflow here)."""
