"""`python -m proving.ledger`: a three-stage chain under fire, then accounted for by `sqsinfer
audit`, which must find every task committed once, and then name exactly what was done to it.

The chain runs behind the fault proxy (S3 5xx and 409s, SQS errors, answers dropped after
the service acted, next-stage send answers lost, latency) with duplicate deliveries,
inference processes SIGKILLed mid-task and workers SIGKILLed (no drain) and restarted.
Then `sqsinfer audit` of the manifest, with every output's lineage checked: 0 missing,
0 written twice, every output of its task and of its stage's model. An audit SIGKILLed
half-way and run again gives the same report. Then 3 outputs are deleted (one a stage),
1 squatted by another task, 2 dead-lettered (output deleted, a copy with a reason in the
stage's dead-letter queue): the audit must name exactly those 6, each in its category.

Three rooms: `chain` (the stand-in, the stages, the workers and the kills), `books`
(the audits and the tampering), `command` (the options, the run, the report).
"""
