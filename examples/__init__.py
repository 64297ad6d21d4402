"""Examples that the test suite imports and runs, so they cannot rot."""
