"""The development stack: Airflow, Celery, PostgreSQL and SeaweedFS started on one machine
(``llm-batch up``), the supervisor that restarts their dead parts, and the executors' task-code
preloading. Not the product: production runs these components on its own infrastructure."""
