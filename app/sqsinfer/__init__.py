"""sqsinfer: a batch ML inference worker. SQS in, S3 out, a spawn pool of models between."""

__version__ = "0.1.0"
