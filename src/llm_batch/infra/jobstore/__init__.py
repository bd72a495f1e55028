"""The job store: jobs, file objects and API keys in our own SQL database.

SQLite file by default (``Settings.database_url``), PostgreSQL by URL; never Airflow's
metadata database. See docs/jobstore.md for the API.
"""

from llm_batch.infra.jobstore.database import make_engine, upgrade_to_head
from llm_batch.infra.jobstore.errors import (
    ApiKeyNotFound,
    ConcurrentUpdate,
    DuplicateId,
    FileNotFound,
    InvalidCursor,
    JobNotFound,
    JobStoreError,
)
from llm_batch.infra.jobstore.snapshots import DIALECTS, FILE_KINDS, ApiKey, FileObject, Job, ShardRecord
from llm_batch.infra.jobstore.store import JobStore, get_job_store, new_file_id, new_job_id, utcnow

__all__ = [
    "DIALECTS",
    "FILE_KINDS",
    "ApiKey",
    "ApiKeyNotFound",
    "ConcurrentUpdate",
    "DuplicateId",
    "FileNotFound",
    "FileObject",
    "InvalidCursor",
    "Job",
    "JobNotFound",
    "JobStore",
    "JobStoreError",
    "ShardRecord",
    "get_job_store",
    "make_engine",
    "new_file_id",
    "new_job_id",
    "upgrade_to_head",
    "utcnow",
]
