"""llm-batch: batch LLM inference as an Apache Airflow pipeline on vLLM's offline engine.

Layers, each a folder, imports running downward only (checked by import-linter, see
pyproject.toml): ``cli`` and ``devstack`` on top; ``api`` (the plugin) and ``airflow`` (the
provider); ``runtime`` (worker and engine); ``pipeline`` (the job's steps); ``infra``
(storage, job store); ``core`` (the canonical job, formats, schemas). Everything below
``airflow`` imports without Airflow, and below ``runtime`` without vLLM: the inference image
installs the package without the Airflow extra.
"""

__version__ = "0.1.0"
