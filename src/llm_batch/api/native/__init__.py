"""The native dialect (``/batch/v1/jobs``): the canonical job's own words, usage and webhooks."""
