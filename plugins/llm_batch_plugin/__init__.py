"""The llm-batch REST API: an Airflow plugin serving one FastAPI app at ``/batch``.

Three dialects (OpenAI batches, Mistral batch jobs, Scale batch completions) over one
canonical job store; translation happens in the routers and ``models_*`` modules only.
"""
