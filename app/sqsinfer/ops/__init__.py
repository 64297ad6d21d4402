"""Operator commands: `enqueue`, `status`, `redrive`, `plan`, `audit` and `diff`.

Each module keeps its own parser (`add_parser(sub)` sets `func`); sqsinfer.cli lists them.
Heavy imports (the AWS SDK, rich) happen when a command runs, not when the CLI starts.
"""

from sqsinfer.ops.audit import add_parser as add_audit
from sqsinfer.ops.diff import add_parser as add_diff
from sqsinfer.ops.enqueue import add_parser as add_enqueue
from sqsinfer.ops.plan import add_parser as add_plan
from sqsinfer.ops.redrive import add_parser as add_redrive
from sqsinfer.ops.status import add_parser as add_status

__all__ = ["add_audit", "add_diff", "add_enqueue", "add_plan", "add_redrive", "add_status"]
