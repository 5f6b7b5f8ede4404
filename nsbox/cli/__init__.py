"""The command line: the only place that prints and picks exit codes (docs/cli.md)."""
