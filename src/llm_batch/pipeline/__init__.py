"""The job's steps as plain functions (validation, sharding, merge, steps, housekeeping...) over core and infra."""
