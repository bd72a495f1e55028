"""The core: the canonical job and its state machine, the job request and run conf, input formats and
request schemas, records and the output layout, placement and settings. Imports nothing else of llm_batch."""
