"""All that a spawned inference process imports: the model handlers, the formats, the task.

Nothing here imports the rest of the package, the AWS SDK, aiohttp or prometheus_client
(a lint contract keeps it so): a process starts fast, and a user's handler module needs
nothing of the worker.
"""
