"""Imported only by the test process: a spawned child never has it, a forked one would."""
