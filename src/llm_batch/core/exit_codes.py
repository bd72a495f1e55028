"""Exit statuses of ``llm-batch worker``, so the runner can tell why a shard stopped."""

DONE = 0
FAILED = 1  # an engine crash or any unexpected error: the attempt failed, retry resumes
USAGE = 2  # bad arguments or configuration (unknown model, bad URI): retrying will not help
CANCELLED = 3  # the job's cancel marker was seen; finished results are flushed
DEADLINE = 4  # the job's deadline passed; finished results are flushed
