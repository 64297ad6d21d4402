"""Operator commands: `enqueue`, `status`, `redrive` and `plan`.

Each module keeps its own parser (`add_parser(sub)` sets `func`); app.cli lists them.
Heavy imports (the AWS SDK, rich) happen when a command runs, not when the CLI starts.
"""

from app.ops.enqueue import add_parser as add_enqueue
from app.ops.plan import add_parser as add_plan
from app.ops.redrive import add_parser as add_redrive
from app.ops.status import add_parser as add_status

__all__ = ["add_enqueue", "add_plan", "add_redrive", "add_status"]
