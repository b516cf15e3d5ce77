"""`engine serve` and the `engine` command: starting, supervising and stopping every process."""
