"""The job's steps as plain functions: validation, sharding, merge, register/plan/finalize
(``steps``), the shard contract, housekeeping and recurring specs. Imports the core and infra."""
