"""The limits of SQS and S3 that the worker and its tools are held to, each spelled once.

From the services' documentation (the SQS Developer Guide's quotas, the S3 User Guide's
object key and metadata pages); where a queue may set its own (MaximumMessageSize), the
value here is the default a new queue has.
"""

from __future__ import annotations

import string

# -- SQS ------------------------------------------------------------------------------------
# Entries in one ReceiveMessage answer, DeleteMessageBatch, ChangeMessageVisibilityBatch or
# SendMessageBatch call.
SQS_BATCH_MAX = 10
# Bytes of all the entries of one SendMessageBatch call, bodies and attributes counted.
SQS_BATCH_MAX_BYTES = 262_144
# A queue's MaximumMessageSize when it cannot be read (SQS's default for a new queue).
SQS_DEFAULT_MAX_MESSAGE_BYTES = 262_144
# Message attributes on one message.
SQS_MAX_ATTRIBUTES = 10
# The longest visibility a message can be given (12 hours) ...
SQS_MAX_VISIBILITY_S = 43_200
# ... and the longest long poll of one ReceiveMessage call.
SQS_MAX_WAIT_S = 20
# A FIFO queue's name ends in this; SQS refuses the suffix on a standard queue.
SQS_FIFO_SUFFIX = ".fifo"
# How long a FIFO queue drops a send whose MessageDeduplicationId it accepted before,
# counted from that first send (it answers each later one as if sent).
SQS_DEDUPLICATION_WINDOW_S = 300
# A FIFO queue's calls per second per action (SendMessage, SendMessageBatch, ...) without
# high throughput mode; each batch call carries up to SQS_BATCH_MAX messages.
SQS_FIFO_CALLS_PER_S = 300
# The longest MessageGroupId and MessageDeduplicationId (ASCII letters, digits, punctuation).
SQS_MAX_FIFO_ID_CHARS = 128
# The fastest rate a message move task (StartMessageMoveTask) can be given, per second.
SQS_MOVE_TASK_MAX_RATE = 500

# A MessageGroupId (FIFO queues; fair queues, on a standard queue): 1 to 128 characters,
# each a letter, a digit or ASCII punctuation.
SQS_GROUP_ID_MAX_CHARS = 128
SQS_GROUP_ID_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)


def is_group_id(text: str) -> bool:
    """Whether SQS takes `text` as a MessageGroupId."""
    return 0 < len(text) <= SQS_GROUP_ID_MAX_CHARS and SQS_GROUP_ID_CHARS.issuperset(text)


# -- S3 -------------------------------------------------------------------------------------
# An object key, in bytes of UTF-8.
S3_MAX_KEY_BYTES = 1024
# Requests per second per partitioned prefix before S3 answers 503 SlowDown (the User
# Guide's performance guidelines): PUT, COPY, POST, DELETE; and GET, HEAD.
S3_PUT_PER_S_PER_PREFIX = 3_500
S3_GET_PER_S_PER_PREFIX = 5_500
# Keys in one listing page (ListObjectsV2, ListObjectVersions).
S3_LIST_PAGE_MAX = 1000
# User-defined metadata of one object: the keys and values of its x-amz-meta-* headers.
S3_MAX_METADATA_BYTES = 2048
