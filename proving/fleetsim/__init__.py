"""A fleet of workers under KEDA, simulated: what `sqsinfer plan` leaves out, counted.

    python -m proving.fleetsim --tasks 15.8M --seconds-per-task 21 --deadline-h 72 --processes 2

The plan is arithmetic on a fleet that starts full and ends together. This runs the job
as a fleet lives it, event by event: KEDA's polls and the HPA's paced scale-up from one
pod, each pod's start and model load, its processes and prefetch, its receives, deletes,
sends and the visibility keeper's extensions, the queue's visibility timeouts and
redeliveries (and its DLQ after maxReceiveCount, its retention), the scale-in at the
end (drained, or in job mode Jobs that exit once idle), SIGKILLs at a rate, S3's request
limits per prefix (SlowDown, and the data path's backoff) and a FIFO queue's; and it
counts the requests each API serves, beside the plan's figures for the same job.

The worker's rules are imported, never restated: the in-flight limit and its receive
batch (`worker.inflight`, the auto prefetch's Little's law included), the keeper's due
rule and cadence (`worker.visibility.due`), which deliveries look first
(`pipeline.looks_first`), what one delivery asks of S3 and the next stage (the plan's
`delivery_requests`), the batchers' linger (`aws.sqs`), the throttle's backoff
(`aws.s3`), the drain (`config.drain_s`), the limits (`sqsinfer.limits`).

Why an event heap of its own, not simpy: the job is 15.8 million tasks, and the budget a
few minutes of one Python process. simpy models each actor as a generator resumed per
event; a process per message (or per worker process) costs a generator switch, an Event
object and a callback list per step: several microseconds, tens of millions of times.
Here an event is a tuple on a `heapq` whose handler works out in place what a pod does at
that moment (`engine`), and a message is an object only while a pod holds it. The events
are the ones the outputs need: a process finishing a task (about one per task), and the
rare ones (pods ready, idle polls ending, kills, lapses, KEDA's periods, samples).

Not installed with the package: run it from a checkout (`make fleet-sim ARGS=...`).
"""
