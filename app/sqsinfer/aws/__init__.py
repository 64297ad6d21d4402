"""The AWS adapters: the SDK session and its clients (`session`), SQS (`sqs`), S3 (`s3`).

Nothing above this folder calls an AWS API directly; nothing in it knows about tasks,
outcomes or the pool.
"""
