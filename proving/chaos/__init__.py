"""`python -m proving.chaos`: a two-stage chain run under fire, then checked from S3 and the queues.

At once: duplicate deliveries, inference processes SIGKILLed mid-task, a worker SIGTERMed
and restarted, another SIGKILLed (no drain at all) and restarted, S3 5xx and 409s, SQS
errors, latency and dropped connections from the fault proxy, next-stage sends whose
answer is lost after SQS took the message, bursts of 503s on the chain marker's "sent"
record, visibility extensions stalled past the visibility timeout while slow tasks hold
their messages, poison messages of several kinds, messages whose JSON escapes characters
SQS refuses, and tasks whose output a producer created first under another task id.
Then, from S3 and the queues alone: every valid task has exactly one correct output per
stage, no output was ever overwritten (bucket versioning), every chain link is recorded
as sent, the queues are empty with nothing in flight, and the dead-letter queue holds
exactly the poison, refused and squatted messages, each with its reason, none without
one. From what the proxy recorded: every message a worker sent is one AWS would accept,
and stage 2 was handed the params stage 1 got. And from the logs: the downstream
duplicates stage 2 received are no more than stage 1 counted, and no message lapsed
while a worker held it. Exit status 1 on any loss.

Four rooms: `workload` (what is fed), `disrupt` (the proxy, the workers and the kills),
`verdict` (the checks), `command` (the options, the run, the report).
"""
