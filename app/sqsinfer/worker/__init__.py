"""The worker: its lifecycle and everything it orchestrates for one message.

`lifecycle` (startup → main loop → shutdown) builds the parts (`assemble`), keeps the
in-flight limit (`inflight`) and hands each message to `pipeline`, which owns its steps
and its one outcome; `chain`, `visibility`, `preflight`, `pool`, `health` and
`model_source` each own one concern.
"""
