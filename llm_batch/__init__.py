"""llm-batch core: importable without Airflow or vLLM (the inference image installs only this)."""

__version__ = "0.1.0"
