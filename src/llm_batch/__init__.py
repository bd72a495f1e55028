"""llm-batch: batch LLM inference as an Apache Airflow pipeline on vLLM's offline engine.

Layers, each a folder, import downward only (README.md, "Module map"; pyproject.toml's
import-linter contracts); below ``airflow`` nothing imports Airflow, below ``runtime`` nothing vLLM.
"""

__version__ = "0.1.0"
