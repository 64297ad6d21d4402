"""What a spawned inference process imports when the worker was started as `sqsinfer`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# The parent's client libraries: an inference process never makes a call.
CLIENT_MODULES = ("aioboto3", "aiobotocore", "aiohttp", "boto3", "botocore", "obstore")

# pip's console script imports the CLI at its top. Spawn runs the parent's main script
# again in each child (as __mp_main__), so each child imports the CLI module too.
SCRIPT = textwrap.dedent(
    f"""
    import multiprocessing
    import sys

    from sqsinfer.cli import main


    def report(queue):
        queue.put(sorted(m for m in {CLIENT_MODULES!r} if m in sys.modules))


    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=report, args=(queue,))
        child.start()
        print(queue.get(timeout=60))
        child.join()
    """
)


def test_a_process_spawned_under_the_console_script_loads_no_client_library(tmp_path):
    script = tmp_path / "sqsinfer"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stderr
