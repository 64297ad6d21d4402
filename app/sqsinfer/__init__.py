"""sqsinfer: a batch ML inference worker. SQS in, S3 out, a spawn pool of models between.

The names a model handler needs, importable without the AWS SDK (spawned inference
processes import this package and must stay light):

    from sqsinfer import Handler, InputError, ModelLoadError
"""

from sqsinfer.compute.errors import InputError, ModelLoadError
from sqsinfer.compute.handlers import Handler

__version__ = "0.2.0"  # the one version: pyproject, the chart and the image follow it
__all__ = ["Handler", "InputError", "ModelLoadError", "__version__"]
