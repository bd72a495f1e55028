"""The Airflow plugin: the batch REST API at ``/batch`` (FastAPI), one folder per dialect
(``native``, ``openai``, ``mistral``, ``scale``) holding its routes and its words, the routes they
share (``routers``), auth in one module, and the app built only where it is served."""
