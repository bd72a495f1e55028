"""The engine runtime: the shard worker, the vLLM engine (``engine/``), warm engines, multi-node
workers and engine services. Imports the pipeline, infra and the core; never Airflow."""
