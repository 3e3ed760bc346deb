"""Offline batch jobs in the OpenAI Batch format: `prelude run-batch` and the server's
/v1/batches. A job's input is read lazily and planned for the prefix cache (plan.py),
run through the server's own routes with no HTTP in between (job.py), and its output is
an append-only, resumable log (output.py)."""
